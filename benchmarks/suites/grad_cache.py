"""Suite ``grad-cache``: the largest CLIP global batch one training step completes on K GPUs
(torchrun), plain and with ``grad_cache_step``; at the first batch both must agree."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks import common
from benchmarks.common import OK, column
from benchmarks.suites import Suite, companions, ring

PLAIN, GRAD_CACHE = "plain", "grad-cache"
METHODS = (PLAIN, GRAD_CACHE)
DEFAULT_BATCHES = (65_536, 131_072, 262_144, 524_288, 1_048_576)
QUICK_BATCHES = (64, 128)
DEFAULT_WIDTH, QUICK_WIDTH = 512, 32
DEFAULT_MICRO_BATCH, QUICK_MICRO_BATCH = 16_384, 16
STEPS = 2  # timed steps after one warm-up step (wall clock between synchronizations)
CHECK_TOLERANCE = 1e-4  # relative L2 of the parameter gradients, float32 towers
IMAGE_SIZE, PATCH, TOKENS, VOCAB = 32, 8, 16, 1024
# (width, blocks, heads) of each tower; MLP 4×
FULL_TOWERS = {"image": (256, 4, 4), "text": (256, 2, 4)}
QUICK_TOWERS = {"image": (32, 1, 2), "text": (32, 1, 2)}


class Tower(nn.Module):
    """Image (uint8 (m, 3, 32, 32), 8×8 patches) or text (ids (m, 16)) tower: the first
    token's state projected to c unit features."""

    def __init__(self, kind: str, shape: tuple[int, int, int], features: int):
        super().__init__()
        width, blocks, heads = shape
        self.kind = kind
        if kind == "image":
            self.embed = nn.Conv2d(3, width, PATCH, stride=PATCH)
            positions = (IMAGE_SIZE // PATCH) ** 2 + 1
            self.cls = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        else:
            self.embed = nn.Embedding(VOCAB, width)
            positions = TOKENS
        self.pos = nn.Parameter(torch.randn(1, positions, width) * 0.02)
        self.blocks = nn.ModuleList(companions.Block(width, heads, 4 * width)
                                    for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "image":
            x = self.embed(x.float().div(127.5).sub(1.0)).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        else:
            x = self.embed(x)
        x = x + self.pos.to(x.dtype)
        for block in self.blocks:
            x = block(x)
        return F.normalize(self.head(self.norm(x[:, 0])), dim=-1)


class Trainer:
    """Both towers in DDP, a learnable logit scale, AdamW, the ring's CLIP loss."""

    def __init__(self, args: argparse.Namespace, ctx: ring.Context):
        torch.manual_seed(args.seed)  # the same initial model on every rank
        device = ctx.device
        ids = [device.index] if device.type == "cuda" else None
        self.towers = [DistributedDataParallel(
            Tower(kind, args.towers[kind], args.width).to(device), device_ids=ids)
            for kind in ("image", "text")]
        self.logit_scale = torch.tensor(math.log(1 / 0.07), device=device, requires_grad=True)
        self.parameters = [p for t in self.towers for p in t.parameters()] + [self.logit_scale]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=1e-4, weight_decay=0.1)
        self.device, self.dtype, self.backend = device, ctx.dtype, ctx.backend
        self.world, self.micro_batch = ctx.world, args.micro_batch

    def loss(self, image_features: Tensor, text_features: Tensor) -> Tensor:
        from fusedloss.distributed import clip_loss
        # features leave F.normalize in float32 under autocast: the loss runs in self.dtype
        return clip_loss(image_features.to(self.dtype), text_features.to(self.dtype),
                         self.logit_scale.exp(), backend=self.backend)

    def step(self, method: str, images: Tensor, texts: Tensor, update: bool = True
             ) -> tuple[float, float]:
        """One training step (without the AdamW update where not ``update``): its wall-clock
        ms between device synchronizations and its loss."""
        from fusedloss.distributed import grad_cache_step
        common.synchronize(self.device)
        begin = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.dtype,
                            enabled=self.dtype != torch.float32):
            if method == PLAIN:
                loss = self.loss(self.towers[0](images), self.towers[1](texts))
                loss.backward()
            else:
                loss = grad_cache_step(self.towers, [images, texts], self.loss,
                                       micro_batch_size=self.micro_batch)
        # the ring gives each rank K × its share of dL/ds: the mean over the ranks is dL/ds
        dist.all_reduce(self.logit_scale.grad)
        self.logit_scale.grad /= self.world
        if update:
            self.optimizer.step()
        loss = float(loss.detach())  # synchronizes
        common.synchronize(self.device)
        return (time.perf_counter() - begin) * 1e3, loss


def make_batch(per_rank: int, rank: int, seed: int, device: torch.device) -> tuple[Tensor, Tensor]:
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank)
    images = torch.randint(0, 256, (per_rank, 3, IMAGE_SIZE, IMAGE_SIZE), generator=g,
                           device=device, dtype=torch.uint8)
    return images, torch.randint(0, VOCAB, (per_rank, TOKENS), generator=g, device=device)


def measure(trainer: Trainer, method: str, batch: int, ctx: ring.Context, seed: int
            ) -> dict[str, Any]:
    """One method at one global batch on every rank: a warm-up step, then STEPS timed steps
    and their peak memory above what exists before a step; failures agreed on every rank."""
    row = {"method": method, "batch": batch, "per_rank": batch // ctx.world, "status": OK,
           "note": ""}
    device, cuda = trainer.device, common.uses_cuda(trainer.device)

    def steps() -> tuple[list[float], float, float | None]:
        data = make_batch(row["per_rank"], ctx.rank, seed, device)
        trainer.step(method, *data)
        if cuda:
            common.release_memory(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        samples = [trainer.step(method, *data) for _ in range(STEPS)]
        peak = (torch.cuda.max_memory_allocated(device) - before) / common.MIB if cuda else None
        return [ms for ms, _ in samples], samples[-1][1], peak

    ok, figures = ctx.stage(row, steps)
    if ok:
        samples, loss, peak = figures
        row["ms_per_rank"] = ctx.gather(statistics.median(samples))
        row["ms"] = max(row["ms_per_rank"])
        row["loss"] = statistics.fmean(ctx.gather(loss))
        row["peak_mib"] = None if peak is None else max(ctx.gather(peak))
    return row


def check_methods(args: argparse.Namespace, ctx: ring.Context) -> dict[str, Any]:
    """Both methods from the same model and batch in float32 must give the same loss and
    gradients (cuDNN's TF32 off: the methods' batch splits would round the patch embedding's
    weight gradient differently)."""
    batch = args.batches[0]
    check: dict[str, Any] = {"batch": batch, "status": OK, "note": ""}
    results = []
    for method in METHODS:
        trainer = Trainer(args, ctx)
        trainer.dtype = torch.float32
        data = make_batch(batch // ctx.world, ctx.rank, args.seed, ctx.device)
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=False):
            ok, result = ctx.stage(check, lambda t=trainer, m=method, d=data: (
                t.step(m, *d, update=False)[1], [p.grad.float().clone() for p in t.parameters]))
        if not ok:
            return check
        results.append(result)
    (plain_loss, plain), (cached_loss, cached) = results
    error = max(common.relative_l2_error(c, p) for c, p in zip(cached, plain, strict=True))
    check.update(loss_plain=plain_loss, loss_grad_cache=cached_loss,
                 max_gradient_error=max(ctx.gather(error)))
    loss_error = abs(plain_loss - cached_loss) / max(1.0, abs(plain_loss))
    if not (check["max_gradient_error"] <= CHECK_TOLERANCE and loss_error <= 1e-5):
        check["status"] = common.WRONG
        check["note"] = f"bounds: {CHECK_TOLERANCE:g} on the gradients, 1e-5 on the loss"
    return check


STEP_COLUMNS = [
    column("method", "method"), column("B", "batch"), column("b_r", "per_rank"),
    column("status", "status"), column("ms per step", "ms", common.format_ms),
    column("peak MB per rank", "peak_mib", common.format_mib),
    column("loss", "loss", common.loss_text), column("note", "note"),
]


def _run(args: argparse.Namespace, ctx: ring.Context) -> int:
    args.batches = sorted(args.batches or (QUICK_BATCHES if args.quick else DEFAULT_BATCHES))
    args.width = QUICK_WIDTH if args.quick else DEFAULT_WIDTH
    args.towers = QUICK_TOWERS if args.quick else FULL_TOWERS
    args.micro_batch = args.micro_batch or (QUICK_MICRO_BATCH if args.quick
                                            else DEFAULT_MICRO_BATCH)
    if common.uses_cuda(ctx.device):
        # cuDNN's attention fails (an execution error, not an out-of-memory) at large batches
        torch.backends.cuda.enable_cudnn_sdp(False)
    check = check_methods(args, ctx)
    ctx.say(f"check: {check}")
    rows: list[dict[str, Any]] = []
    for method in METHODS:
        trainer = Trainer(args, ctx)
        for batch in args.batches:  # until a failure or a step over --max-step-s
            rows.append(measure(trainer, method, batch, ctx, args.seed))
            ctx.say(common.table(STEP_COLUMNS, rows[-1:], text=True).splitlines()[-1])
            if rows[-1]["status"] != OK or rows[-1]["ms"] > args.max_step_s * 1e3:
                break
        trainer = None
        common.release_memory(ctx.device)
    if ctx.rank == 0:
        largest = {m: max((r["batch"] for r in rows if r["method"] == m and r["status"] == OK),
                          default=None) for m in METHODS}
        body = common.section("Steps", f"ms: max over the ranks of each rank's median of {STEPS} "
                              "steps after a warm-up step. Largest B one step completed: "
                              f"{largest}. Check (float32, same model, B = {args.batches[0]}): "
                              f"{check}.", STEP_COLUMNS, rows)
        ring.write_report(args, ctx, "Gradient Cache + ring CLIP training step", body,
                          {"check": check, "rows": rows, "largest": largest},
                          common.table(STEP_COLUMNS[:6], rows, text=True))
    ctx.barrier()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--batches", type=common.int_list, default=None,
        help=f"comma list of global batches B (default {','.join(map(str, DEFAULT_BATCHES))})")
    add("--micro-batch", type=int, default=None,
        help=f"Gradient Cache micro-batch rows (default {DEFAULT_MICRO_BATCH})")
    add("--max-step-s", type=float, default=60.0,
        help="stop a method's sweep after a step this long (default 60 s)")
    common.add_common_arguments(parser, "B 64,128, tiny towers: a smoke test (gloo)")


SUITE = Suite("grad-cache", "CLIP training step over K processes (torchrun): Gradient Cache + "
              "the ring against a plain step, up to the largest global batch", add_arguments,
              lambda args: ring.run_distributed(args, _run))
