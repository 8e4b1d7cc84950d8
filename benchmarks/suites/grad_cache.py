"""Suite ``grad-cache`` (benchmarks/README.md): the largest CLIP global batch one training step
completes on K GPUs, plain and with ``grad_cache_step``; the first batch checks both agree."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks import common
from benchmarks.common import OK, OUT_OF_MEMORY
from benchmarks.suites import Suite
from benchmarks.suites.ring import Context, Ranks, positive_int_list, run_distributed, stage

NAME = "grad-cache"
RESULTS_PREFIX = "grad_cache"
PLAIN, GRAD_CACHE = "plain", "grad-cache"
METHODS = (PLAIN, GRAD_CACHE)
DEFAULT_BATCHES = (65_536, 131_072, 262_144, 524_288, 1_048_576)
QUICK_BATCHES = (64, 128)
DEFAULT_WIDTH, QUICK_WIDTH = 512, 32
DEFAULT_MICRO_BATCH, QUICK_MICRO_BATCH = 16_384, 16
STEPS = 2  # timed steps per figure
DEFAULT_MAX_STEP_S = 60.0
CHECK_TOLERANCE = 1e-4  # relative L2 of the parameter gradients, float32 towers
IMAGE_SIZE, PATCH, TOKENS, VOCAB = 32, 8, 16, 1024


@dataclass(frozen=True)
class TowerShape:
    width: int
    layers: int
    heads: int

    def __str__(self) -> str:
        return f"width {self.width}, {self.layers} blocks, {self.heads} heads, MLP 4×"


FULL_TOWERS = {"image": TowerShape(256, 4, 4), "text": TowerShape(256, 2, 4)}
QUICK_TOWERS = {"image": TowerShape(32, 1, 2), "text": TowerShape(32, 1, 2)}

TIMING_DEFINITION = (
    "ms = max over the ranks of each rank's median wall time (between CUDA synchronizations) of "
    "one training step (zero_grad, the method's forward and backward in bf16 autocast, DDP's "
    "all-reduce, the logit scale's gradient averaged, AdamW step); {steps} timed steps after "
    "one warm-up step"
)
MEMORY_DEFINITION = (
    "peak MB per rank = (max_memory_allocated() during one step − memory_allocated() before "
    "it) / 2^20, max over the ranks; the model, AdamW state, inputs and gradient buffers that "
    "exist before the step are not counted"
)


class Block(nn.Module):  # pre-norm attention and 4× MLP

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, w = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads)
        a = F.scaled_dot_product_attention(*qkv.permute(2, 0, 3, 1, 4))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Tower(nn.Module):
    """Image (uint8 (m, 3, 32, 32), 8×8 patches) or text (ids (m, 16)) tower: the first
    token's state projected to c features."""

    def __init__(self, kind: str, shape: TowerShape, features: int):
        super().__init__()
        self.kind, w = kind, shape.width
        if kind == "image":
            self.embed = nn.Conv2d(3, w, PATCH, stride=PATCH)
            positions = (IMAGE_SIZE // PATCH) ** 2 + 1
            self.cls = nn.Parameter(torch.randn(1, 1, w) * 0.02)
        else:
            self.embed = nn.Embedding(VOCAB, w)
            positions = TOKENS
        self.pos = nn.Parameter(torch.randn(1, positions, w) * 0.02)
        self.blocks = nn.ModuleList(Block(w, shape.heads) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(w)
        self.head = nn.Linear(w, features, bias=False)

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


@dataclass
class Trainer:
    towers: list[nn.Module]  # each in DDP
    logit_scale: Tensor
    optimizer: torch.optim.Optimizer
    device: torch.device
    dtype: torch.dtype
    backend: str
    world: int
    micro_batch: int

    def loss(self, image_features: Tensor, text_features: Tensor) -> Tensor:
        from fusedloss.distributed import clip_loss

        # features leave F.normalize in float32 under autocast: the loss runs in self.dtype
        return clip_loss(image_features.to(self.dtype), text_features.to(self.dtype),
                         self.logit_scale.exp(), backend=self.backend)

    def step(self, method: str, images: Tensor, texts: Tensor) -> Tensor:
        from fusedloss.distributed import grad_cache_step

        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.dtype,
                            enabled=self.dtype != torch.float32):
            if method == PLAIN:
                loss = self.loss(self.towers[0](images), self.towers[1](texts))
                loss.backward()
                loss = loss.detach()
            else:
                loss = grad_cache_step(self.towers, [images, texts], self.loss,
                                       micro_batch_size=self.micro_batch)
        # the ring gives each rank W × its share of dL/ds: the mean over the ranks is dL/ds
        dist.all_reduce(self.logit_scale.grad)
        self.logit_scale.grad /= self.world
        self.optimizer.step()
        return loss

    def gradients(self) -> list[Tensor]:
        params = [p for tower in self.towers for p in tower.parameters()]
        return [p.grad.detach().float().clone() for p in params + [self.logit_scale]]


def make_trainer(width: int, towers: dict[str, TowerShape], device: torch.device,
                 dtype: torch.dtype, backend: str, micro_batch: int, seed: int) -> Trainer:
    torch.manual_seed(seed)  # the same initial model on every rank
    modules = [Tower(kind, towers[kind], width).to(device) for kind in ("image", "text")]
    ids = [device.index] if device.type == "cuda" else None
    wrapped: list[nn.Module] = [DistributedDataParallel(m, device_ids=ids) for m in modules]
    logit_scale = torch.tensor(math.log(1 / 0.07), device=device, requires_grad=True)
    params = [p for m in wrapped for p in m.parameters()] + [logit_scale]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    return Trainer(wrapped, logit_scale, optimizer, device, dtype, backend,
                   dist.get_world_size(), micro_batch)


def make_batch(per_rank: int, rank: int, seed: int, device: torch.device) -> tuple[Tensor, Tensor]:
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank)
    images = torch.randint(0, 256, (per_rank, 3, IMAGE_SIZE, IMAGE_SIZE), generator=g,
                           device=device, dtype=torch.uint8)
    return images, torch.randint(0, VOCAB, (per_rank, TOKENS), generator=g, device=device)


@dataclass
class Row:
    method: str
    batch: int
    per_rank: int
    status: str = OK
    note: str = ""
    ms: float | None = None
    ms_per_rank: list[float] = field(default_factory=list)
    peak_mib: float | None = None
    loss: float | None = None
    first_step_ms: float | None = None


@dataclass
class Check:
    batch: int
    loss_plain: float | None = None
    loss_grad_cache: float | None = None
    max_gradient_error: float | None = None
    status: str = OK
    note: str = ""


def _timed_step(trainer: Trainer, method: str, images: Tensor, texts: Tensor
                ) -> tuple[float, float]:
    common.synchronize(trainer.device)
    begin = time.perf_counter()
    loss = trainer.step(method, images, texts)
    common.synchronize(trainer.device)
    return (time.perf_counter() - begin) * 1e3, float(loss)


def measure(trainer: Trainer, method: str, batch: int, ranks: Ranks, seed: int,
            steps: int) -> Row:
    """One method at one global batch on every rank; failures agreed on every rank."""
    row, device = Row(method, batch, batch // ranks.world), trainer.device
    ok, data = stage(ranks, row, device, lambda: make_batch(row.per_rank, ranks.rank, seed,
                                                            device))
    if ok:
        ok, first = stage(ranks, row, device, lambda: _timed_step(trainer, method, *data))
    if not ok:
        return row
    row.first_step_ms = ranks.max(first[0])
    cuda = common.uses_cuda(device)

    def timed() -> tuple[list[float], float, float | None]:
        if cuda:
            common.release_memory(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        samples, loss = [], math.nan
        for _ in range(steps):
            ms, loss = _timed_step(trainer, method, *data)
            samples.append(ms)
        peak = (torch.cuda.max_memory_allocated(device) - before) / common.MIB if cuda else None
        return samples, loss, peak

    ranks.barrier()
    ok, figures = stage(ranks, row, device, timed)
    if not ok:
        return row
    samples, loss, peak = figures
    row.ms_per_rank = ranks.gather(statistics.median(samples))
    row.ms = max(row.ms_per_rank)
    row.loss = statistics.fmean(ranks.gather(loss))
    if peak is not None:
        row.peak_mib = ranks.max(peak)
    return row


def check_methods(make: Callable[[], Trainer], batch: int, ranks: Ranks, seed: int) -> Check:
    """Both methods from the same initial model and batch in float32: the same loss and
    parameter gradients up to the order of float additions."""
    check, results = Check(batch), {}
    for method in METHODS:
        trainer = make()
        trainer.dtype = torch.float32
        images, texts = make_batch(batch // ranks.world, ranks.rank, seed, trainer.device)
        trainer.optimizer.step = lambda: None  # keep the parameters: gradients only
        ok, loss = stage(ranks, check, trainer.device,
                         lambda t=trainer, m=method, i=images, x=texts: float(t.step(m, i, x)))
        if not ok:
            return check
        results[method] = (loss, trainer.gradients())
    check.loss_plain, plain = results[PLAIN]
    check.loss_grad_cache, cached = results[GRAD_CACHE]
    error = max(common.relative_l2_error(c, p) for c, p in zip(cached, plain, strict=True))
    check.max_gradient_error = ranks.max(error)
    loss_error = abs(check.loss_plain - check.loss_grad_cache) / max(1.0, abs(check.loss_plain))
    if not (check.max_gradient_error <= CHECK_TOLERANCE and loss_error <= 1e-5):
        check.status = common.WRONG
        check.note = (f"loss {check.loss_plain:.6g} vs {check.loss_grad_cache:.6g}, gradients "
                      f"{check.max_gradient_error:.2e} (bound {CHECK_TOLERANCE:g})")
    return check


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--batches", type=positive_int_list, default=None,
        help="comma list of global batches B, increasing (default "
        f"{','.join(map(str, DEFAULT_BATCHES))}; {','.join(map(str, QUICK_BATCHES))} with "
        "--quick)")
    add("--methods", type=common.comma_list(METHODS), default=list(METHODS),
        help="comma list of plain, grad-cache (default both)")
    add("--micro-batch", type=int, default=None,
        help=f"Gradient Cache micro-batch rows (default {DEFAULT_MICRO_BATCH})")
    add("--max-step-s", type=float, default=DEFAULT_MAX_STEP_S,
        help=f"stop a method's sweep after a step this long (default {DEFAULT_MAX_STEP_S:g} s)")
    common.add_dtype_seed_arguments(parser)
    common.add_quick_device_timing_arguments(
        parser, "batches 64,128, tiny towers: a smoke test that also runs on CPU (gloo)")
    add("--out", default=common.RESULTS_DIR, help="results directory")
    add("--tag", default=None, help="suffix for the results file names")


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    return run_distributed(args, NAME, _run, log)


def _run(args: argparse.Namespace, ctx: Context) -> int:
    ranks, device, say, world = ctx.ranks, ctx.device, ctx.say, ctx.ranks.world
    batches = sorted(args.batches or (QUICK_BATCHES if ctx.quick else DEFAULT_BATCHES))
    if any(b % world for b in batches):
        say(f"every global batch must be a multiple of the world size {world}: {batches}")
        return 2
    width, towers = (QUICK_WIDTH, QUICK_TOWERS) if ctx.quick else (DEFAULT_WIDTH, FULL_TOWERS)
    micro = args.micro_batch or (QUICK_MICRO_BATCH if ctx.quick else DEFAULT_MICRO_BATCH)
    if common.uses_cuda(device):
        # cuDNN's attention fails (an execution error, not an out-of-memory) at large batches
        torch.backends.cuda.enable_cudnn_sdp(False)

    def make() -> Trainer:
        return make_trainer(width, towers, device, ctx.dtype, ctx.backend, micro, ctx.seed)

    say(f"grad-cache on {world} × {ctx.environment.get('device_name')} ({ctx.dist_backend}): c = "
        f"{width}, micro-batch {micro}, batches {batches}, methods {args.methods}")
    check = check_methods(make, batches[0], ranks, ctx.seed) if len(args.methods) == 2 else None
    if check is not None:
        say(f"check at B={batches[0]}: loss {check.loss_plain} vs {check.loss_grad_cache}, "
            f"max gradient error {check.max_gradient_error} ({check.status}) {check.note}")
    rows: list[Row] = []
    for method in args.methods:
        trainer = make()
        for batch in batches:
            row = measure(trainer, method, batch, ranks, ctx.seed, STEPS)
            rows.append(row)
            say(f"{method:10s} B={batch:>9d} (b_r {row.per_rank}): {row.status} "
                f"{common.format_ms(row.ms)} ms, {common.format_mib(row.peak_mib)} MB, loss "
                f"{row.loss} {row.note}")
            if row.status != OK or (row.ms is not None and row.ms > args.max_step_s * 1e3):
                break
        del trainer
        common.release_memory(device)
    if ranks.rank == 0:
        _report(args, ctx, width, micro, towers, check, rows)
    ranks.barrier()
    return 0


def largest_batch(rows: Sequence[Row], method: str) -> int | None:
    return max((r.batch for r in rows if r.method == method and r.status == OK), default=None)


def _stop_reason(rows: Sequence[Row], method: str, max_step_s: float) -> str:
    mine = [r for r in rows if r.method == method]
    if not mine:
        return "not run"
    last = mine[-1]
    if last.status == OUT_OF_MEMORY:
        return f"out of memory at B = {last.batch}"
    if last.status != OK:
        return f"{last.status} at B = {last.batch}: {last.note}"
    if last.ms is not None and last.ms > max_step_s * 1e3:
        return f"step time above {max_step_s:g} s at B = {last.batch} (memory did not stop it)"
    return "the largest batch asked for (memory did not stop it)"


def _report(args, ctx: Context, width, micro, towers, check, rows) -> None:
    env, world, timing = ctx.environment, ctx.ranks.world, TIMING_DEFINITION.format(steps=STEPS)
    settings = common.environment_rows(env, {})[:3] + [
        ("date", env["timestamp"]),
        ("ranks", f"K = {world}, torch.distributed backend {ctx.dist_backend}"),
        ("model", f"image tower ViT-style {IMAGE_SIZE}×{IMAGE_SIZE} px, patch {PATCH}, "
         f"{towers['image']}; text tower {TOKENS} tokens, {towers['text']}; features c = "
         f"{width}; each tower in DistributedDataParallel; AdamW"),
        ("loss", "fusedloss.distributed.clip_loss (ring), learnable logit scale"),
        ("dtype", f"{common.dtype_name(ctx.dtype)} autocast"),
        ("Gradient Cache", f"micro-batches of {micro} rows per rank"),
        ("timing", timing), ("memory", MEMORY_DEFINITION),
    ]
    lines = [f"# Gradient Cache + ring CLIP training step on {world} × {env['device_name']}, "
             f"{env['date']}", "", common.markdown_table(["setting", "value"], settings), ""]
    if check is not None:
        lines += ["## Check", "", f"At B = {check.batch}, both methods from the same initial "
                  f"model, float32: loss plain {check.loss_plain}, Gradient Cache "
                  f"{check.loss_grad_cache}; max over parameters and ranks of the relative L2 "
                  f"error of the gradients {common.format_error(check.max_gradient_error)} "
                  f"(bound {CHECK_TOLERANCE:g}): {check.status} {check.note}", ""]
    lines += ["## Steps", "", common.markdown_table(
        ["method", "global batch B", "b_r per rank", "status", "ms per step", "ms per rank",
         "peak MB per rank", "loss", "first step ms", "note"],
        [[r.method, r.batch, r.per_rank, r.status, common.format_ms(r.ms),
          " / ".join(common.format_ms(v) for v in r.ms_per_rank),
          common.format_mib(r.peak_mib), "—" if r.loss is None else f"{r.loss:.5f}",
          common.format_ms(r.first_step_ms), r.note] for r in rows]), ""]
    largest = {m: largest_batch(rows, m) for m in args.methods}
    lines += ["## Largest global batch one step completed", "", common.markdown_table(
        ["method", "largest B", "why the sweep stopped"],
        [[m, largest[m] or "—", _stop_reason(rows, m, args.max_step_s)]
         for m in args.methods]), ""]
    payload = {"environment": env, "world": world, "backend": ctx.dist_backend,
               "width": width, "micro_batch": micro, "steps": STEPS,
               "towers": {k: asdict(v) for k, v in towers.items()},
               "check": asdict(check) if check else None,
               "rows": [asdict(r) for r in rows], "largest": largest,
               "timing": timing, "memory": MEMORY_DEFINITION}
    common.report_results(
        args.out, RESULTS_PREFIX, args.tag, env, (), markdown="\n".join(lines), payload=payload,
        tables=common.text_table(["method", "B", "status", "ms", "MB/rank"],
                                 [[r.method, r.batch, r.status, common.format_ms(r.ms),
                                   common.format_mib(r.peak_mib)] for r in rows]),
        world=world, log=ctx.say)


SUITE = Suite(
    name=NAME,
    help="CLIP training step over K processes (torchrun): Gradient Cache + the ring against a "
    "plain step, up to the largest global batch",
    add_arguments=add_arguments,
    run=run,
)
