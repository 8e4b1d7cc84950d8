"""Suite ``companions``: SwitchBack linear layers (eager and CUDA-graphed), the StableAdamW step
and a CLIP training run, in bf16 (docs/companions.md; columns: benchmarks/README.md)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import math
import statistics
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks import common
from benchmarks.common import TimingSettings, column, format_mib, format_ms, loss_text
from benchmarks.suites import Suite

NAME = "companions"
PARTS = ("linear", "optimizer", "e2e")
UNAVAILABLE_ERRORS = (TypeError, ValueError, NotImplementedError)  # an option this build lacks
TRITON_TIMING = TimingSettings(warmup_ms=25.0, rep_ms=100.0)  # do_bench's own defaults
# Label and SwitchBackLinear options per provider (None: nn.Linear, the baseline, first)
LINEAR_PROVIDERS: dict[str, tuple[str, dict | None]] = {
    "torch": ("nn.Linear", None), "switchback": ("SwitchBack", {}),
    "switchback-m": ("SwitchBackM", {"memory_efficient": True}),
    "switchback-q": ("SwitchBackQ", {"weight_quantization": "rowwise"}),
    "fp8": ("SwitchBack fp8", {"quant_dtype": "fp8"}),
}
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)  # CLIP's, β2 0.99
OPTIMIZERS = {  # StableAdamW's default fused=None: the fused kernels on CUDA
    "stable-adamw": ("StableAdamW", {}),
    "stable-adamw-foreach": ("StableAdamW foreach", {"fused": False}),
    "adamw-foreach": ("AdamW foreach", {"foreach": True}),
    "adamw-fused": ("AdamW fused", {"fused": True}),  # the yardstick, last
}
E2E_PROVIDERS = ("torch", "switchback", "fp8")  # nn.Linear, int8 and fp8 SwitchBack
SHAPES = {"d-d": (1, 1), "d-4d": (1, 4), "4d-d": (4, 1)}  # (in, out) as multiples of d
LR = 5e-4  # StableAdamW's peak in the e2e run


# The CLIP model: CLIP ViT-B/16's image tower in open_clip's layout; a text MLP on fixed text_dim
# embeddings; embed_dim, the joint space; latent_dim, what a synthetic image and its text share.
VIT_B_16 = SimpleNamespace(image_size=224, patch_size=16, width=768, layers=12, heads=12,
                           mlp_width=3072, embed_dim=512, text_dim=256, text_hidden=1024,
                           latent_dim=64)
VIT_TINY = SimpleNamespace(image_size=32, patch_size=8, width=32, layers=2, heads=2, mlp_width=128,
                           embed_dim=16, text_dim=24, text_hidden=32, latent_dim=8)  # --quick


class Block(nn.Module):
    """Pre-norm attention and MLP (open_clip's layout); grad-cache's towers use it too."""

    def __init__(self, width: int, heads: int, mlp_width: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.ModuleDict(dict(qkv=nn.Linear(width, 3 * width),
                                       proj=nn.Linear(width, width)))
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(OrderedDict(fc1=nn.Linear(width, mlp_width), gelu=nn.GELU(),
                                             fc2=nn.Linear(mlp_width, width)))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, width)
        batch, tokens, _ = x.shape
        qkv = self.attn.qkv(self.ln_1(x)).view(batch, tokens, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, heads, T, width / heads)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        x = x + self.attn.proj(out)
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        width, scale = config.width, config.width**-0.5
        self.patch_embed = nn.Conv2d(3, width, config.patch_size, config.patch_size, bias=False)
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        tokens = (config.image_size // config.patch_size) ** 2 + 1  # patches and the class token
        self.positional_embedding = nn.Parameter(scale * torch.randn(tokens, width))
        self.ln_pre = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(Block(width, config.heads, config.mlp_width)
                                    for _ in range(config.layers))
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Linear(width, config.embed_dim, bias=False)

    def forward(self, images: Tensor) -> Tensor:  # (B, 3, S, S) → (B, embed_dim), not normalized
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, grid², width)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = self.ln_pre(torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype))
        for block in self.blocks:
            x = block(x)
        return self.proj(self.ln_post(x[:, 0]))


class ClipModel(nn.Module):
    """L2-normalized image and text features, and logit_scale.exp() clamped at 100."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.visual = VisionTransformer(config)
        self.text = nn.Sequential(nn.Linear(config.text_dim, config.text_hidden), nn.GELU(),
                                  nn.Linear(config.text_hidden, config.embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: Tensor, texts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        image_features = F.normalize(self.visual(images), dim=-1)
        text_features = F.normalize(self.text(texts), dim=-1)
        return image_features, text_features, self.logit_scale.exp().clamp(max=100.0)


def synthetic_pairs(config: SimpleNamespace, seed: int, device: torch.device,
                    batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """(images, texts) batches sharing a latent z ~ N(0, I), the same for a seed: image = a fixed
    map of z, upsampled, + N(0, 0.5²); text = tanh(z A) B (unit variance) + N(0, 0.25²)."""
    generator = torch.Generator().manual_seed(seed)
    latent, size = config.latent_dim, config.image_size
    grid = size // config.patch_size
    image_map = torch.randn(latent, 3 * grid * grid, generator=generator) / latent**0.5
    text_hidden = torch.randn(latent, 4 * latent, generator=generator) * (2 / latent**0.5)
    text_out = torch.randn(4 * latent, config.text_dim, generator=generator) / (4 * latent)**0.5
    probe = torch.tanh(torch.randn(4096, latent, generator=generator) @ text_hidden) @ text_out
    image_map, text_hidden = image_map.to(device), text_hidden.to(device)
    text_out = (text_out / probe.std(dim=0)).to(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    while True:
        z = torch.randn(batch_size, latent, generator=generator, device=device)
        small = (z @ image_map).view(batch_size, 3, grid, grid)
        images = F.interpolate(small, size=(size, size), mode="bilinear", align_corners=False)
        texts = torch.tanh(z @ text_hidden) @ text_out
        image_noise = torch.randn(images.shape, generator=generator, device=device)
        text_noise = torch.randn(texts.shape, generator=generator, device=device)
        yield images + 0.5 * image_noise, texts + 0.25 * text_noise


# Sizes: linear widths (CLIP ViT-B, -L, -H, -G), tokens; e2e batch, steps, untimed first steps
FULL = dict(widths=[768, 1024, 1280, 1664], tokens=[8192, 16384, 32768, 65536], batch=256,
            steps=300, warmup_steps=20, model=VIT_B_16)
QUICK = dict(widths=[32], tokens=[64, 128], batch=8, steps=3, warmup_steps=1, model=VIT_TINY)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


@contextlib.contextmanager
def recorded(row: common.Row, device: torch.device) -> Iterator[None]:
    """``common.failures_recorded``, an error of UNAVAILABLE_ERRORS recorded unavailable."""
    with common.failures_recorded(row, device):
        try:
            yield
        except UNAVAILABLE_ERRORS as error:
            row["status"], row["note"] = common.UNAVAILABLE, common.describe_error(error)


def graphed_ms(step: Callable[[], None], device: torch.device,
               timing: TimingSettings) -> float | None:
    """Median replay time of ``step`` captured in a CUDA graph; None without CUDA."""
    if not common.uses_cuda(device):
        return None
    graph, _ = common.capture_graph(step, device, 3)  # after 3 steps on a side stream
    return common.median_ms(graph.replay, device, timing)


def measure_linear(provider: str, case: str, base: nn.Linear, x: Tensor, dy: Tensor,
                   reference: tuple[Tensor, ...], s: SimpleNamespace,
                   device: torch.device) -> common.Row:
    """One provider's row, its layer sharing ``base``'s weight and bias."""
    from fusedloss.nn import SwitchBackLinear

    label, options = LINEAR_PROVIDERS[provider]
    row = common.new_row(provider, label, case=case, graphed_ms=None)
    with recorded(row, device):
        layer = base if options is None else SwitchBackLinear.from_linear(
            base, backend=s.backend, **options)

        def step() -> Tensor:
            x.grad = layer.weight.grad = layer.bias.grad = None
            y = layer(x)
            y.backward(dy)
            return y.detach()

        errors = [common.relative_l2_error(value, expected) for value, expected in zip(
            (step(), x.grad, layer.weight.grad), reference, strict=True)]  # step() sets the grads
        row["y_error"], row["dx_error"], row["dw_error"] = errors
        x.grad = layer.weight.grad = layer.bias.grad = None
        gradient_bytes = common.tensor_bytes((x, layer.weight, layer.bias))
        row["peak_extra_mib"] = common.peak_extra_mib(step, device, gradient_bytes)
        row["ms"] = common.median_ms(step, device, s.timing)
        if not all(map(math.isfinite, errors)):
            row["status"], row["note"] = common.WRONG, "y, dx or dw not finite"
        row["graphed_ms"] = graphed_ms(step, device, s.timing)  # a failure keeps the eager figures
    return row


def run_linear(s: SimpleNamespace, device: torch.device, log: Callable) -> list[dict]:
    """Every width × shape × token count (widths outermost), a row per provider; x, dy ~ N(0, 1)
    and weight, bias ~ U(±1/sqrt(in)) drawn in float32, rounded to bf16."""
    rows = []
    for width, (times_in, times_out), tokens in itertools.product(s.widths, SHAPES.values(),
                                                                  s.tokens):
        n_in, n_out = times_in * width, times_out * width
        generator = torch.Generator(device=device).manual_seed(s.seed)
        x, dy = (torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
                 for shape in ((tokens, n_in), (tokens, n_out)))
        base = nn.Linear(n_in, n_out, device=device, dtype=torch.bfloat16)
        for parameter in (base.weight, base.bias):
            uniform = 2 * torch.rand(parameter.shape, generator=generator, device=device) - 1
            parameter.data.copy_(uniform * n_in**-0.5)
        # the reference: a float32 nn.Linear (TF32 off: PyTorch's default) on the same values
        x32, w32 = x.float().requires_grad_(), base.weight.detach().float().requires_grad_()
        y32 = F.linear(x32, w32, base.bias.detach().float())
        reference = (y32.detach(), *torch.autograd.grad(y32, (x32, w32), dy.float()))
        x.requires_grad_()
        case = f"{n_in}x{n_out} N{tokens}"
        results = [measure_linear(p, case, base, x, dy, reference, s, device)
                   for p in LINEAR_PROVIDERS]
        for row in results:
            row["speedup"] = ratio(results[0]["ms"], row["ms"])
            row["graphed_speedup"] = ratio(results[0]["graphed_ms"], row["graphed_ms"])
        log(f"  {case}: " + ", ".join(f"{r['label']} {format_ms(r['ms'])} ms" for r in results))
        rows += results
    return rows


def host_syncs(step: Callable[[], Any], device: torch.device) -> str:
    """Two calls under ``set_sync_debug_mode("error")``: "none" or the first sync's error."""
    if not common.uses_cuda(device):
        return "n/a (no CUDA)"
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    except RuntimeError as error:
        return "synchronizes: " + common.describe_error(error)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "none"


def run_optimizer(s: SimpleNamespace, device: torch.device) -> list[dict]:
    """A step of each optimizer over the image tower's parameters (gradients 1e-2·N(0, 1))."""
    from fusedloss.optim import StableAdamW

    torch.manual_seed(s.seed)
    with torch.device(device):
        params = list(VisionTransformer(s.model).parameters())
    generator = torch.Generator(device=device).manual_seed(s.seed)
    for p in params:
        p.grad = 1e-2 * torch.randn(p.shape, generator=generator, device=device)
    rows = []
    for key, (label, options) in OPTIMIZERS.items():
        row = common.new_row(key, label)
        kind = StableAdamW if key.startswith("stable") else torch.optim.AdamW
        with recorded(row, device):
            optimizer = kind(params, **HYPER, **options)
            optimizer.step()  # creates the state
            row["host_syncs"] = host_syncs(optimizer.step, device)
            row["peak_extra_mib"] = common.peak_extra_mib(optimizer.step, device)
            row["ms"] = common.median_ms(optimizer.step, device, s.timing)
        rows.append(row)
    for row in rows:
        row["vs_fused"] = ratio(row["ms"], rows[-1]["ms"])  # rows[-1]: fused AdamW
    return rows


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 10 % of the steps, then cosine decay to 0.1."""
    warmup = max(1, round(0.1 * steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def train(provider: str, s: SimpleNamespace, device: torch.device) -> dict:
    """``s.steps`` steps of a fresh model; the same seed and batches for every provider."""
    import fusedloss
    from fusedloss.optim import StableAdamW
    from fusedloss.switchback import swap_linear_layers

    label, options = LINEAR_PROVIDERS[provider]
    row = common.new_row(provider, label, swapped=0, final_loss=None, losses=[], step_ms=[])
    with recorded(row, device):
        torch.manual_seed(s.seed)
        model = ClipModel(s.model).to(device)
        if options is not None:
            # the blocks' linears, not the patch embedding or the head
            row["swapped"] = len(swap_linear_layers(model.visual, include="blocks.*",
                                                 backend=s.backend, **options))
        groups = [{"params": [p for p in model.parameters() if (p.ndim >= 2) == matrix],
                   "weight_decay": HYPER["weight_decay"] if matrix else 0.0}  # matrices only
                  for matrix in (True, False)]
        optimizer = StableAdamW(groups, lr=LR, betas=HYPER["betas"], eps=HYPER["eps"])
        loss_fn = fusedloss.ClipLoss()
        batches = synthetic_pairs(s.model, s.seed, device, s.batch)

        def step(images: Tensor, texts: Tensor) -> Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                features = model(images, texts)
            loss = loss_fn(*features)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        if common.uses_cuda(device):
            torch.cuda.reset_peak_memory_stats(device)
        for index in range(s.steps):
            for group in optimizer.param_groups:
                group["lr"] = LR * lr_factor(index, s.steps)
            ms, loss = common.timed(step, device, *next(batches))
            row["losses"].append(float(loss))
            row["step_ms"].append(ms)
        row["ms"] = statistics.median(row["step_ms"][s.warmup_steps:] or row["step_ms"][-1:])
        row["images_per_s"] = s.batch / (row["ms"] * 1e-3)
        if common.uses_cuda(device):
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["final_loss"] = statistics.fmean(row["losses"][-10:])  # the mean of the last 10
        if not all(map(math.isfinite, row["losses"])):
            row["status"], row["note"] = common.WRONG, "non-finite loss"
    return row


MS = ("ms", lambda row: row["status"] if row["ms"] is None else format_ms(row["ms"]))
ERROR, TIMES = common.format_error, "{:.2f}×".format
COLUMNS = {  # per part, the first columns also the terminal's
    "linear": [column("case", "case"), column("provider", "label"), MS,
               column("speed-up", "speedup", TIMES), column("graphed ms", "graphed_ms", format_ms),
               column("graphed ×", "graphed_speedup", TIMES), column("status", "status"),
               column("peak MB", "peak_extra_mib", format_mib), column("y err", "y_error", ERROR),
               column("dx err", "dx_error", ERROR), column("dw err", "dw_error", ERROR)],
    "optimizer": [column("optimizer", "label"), MS, column("× fused", "vs_fused", TIMES),
                  column("host syncs", "host_syncs"), column("status", "status"),
                  column("peak MB", "peak_extra_mib", format_mib)],
    "e2e": [column("variant", "label"), MS, column("images/s", "images_per_s", common.count_text),
            column("peak GiB", "peak_gib", common.format_ratio),
            column("first loss", "losses", lambda losses: loss_text(losses[0] if losses else None)),
            column("final loss", "final_loss", loss_text),
            column("Δ final loss", "final_loss_delta", "{:+.4f}".format),
            column("status", "status"), column("swapped linears", "swapped")],
}


def write_report(report: dict, s: SimpleNamespace, args: argparse.Namespace, log: Callable) -> None:
    """The settings, a section per part, the notes; the first six columns on the terminal."""
    env = report["environment"]
    with torch.device("meta"):
        tower = list(VisionTransformer(s.model).parameters())
    settings = [*common.environment_rows(env, {}), common.matmul_row(report["matmul"]),
                ("timing", report["timing"]),
                ("model; SwitchBack backend; seed", f"{s.model}; {s.backend}; {s.seed}"),
                ("optimizer", f"the image tower's {len(tower)} tensors, "
                 f"{sum(p.numel() for p in tower) / 1e6:.2f} M float32 parameters; {HYPER}"),
                ("e2e", f"batch {s.batch}, {s.steps} steps ({s.warmup_steps} untimed), "
                 f"peak lr {LR:g}")]
    body = ["Columns: benchmarks/README.md (the `companions` suite).", ""]
    for part in s.parts:
        body += common.section(part, "", COLUMNS[part] + [column("note", "note")], report[part])
    tables = [common.table(COLUMNS[part][:6], report[part], text=True) for part in s.parts]
    common.write_report(args.out, NAME, args.tag, env, "Low-precision training companions",
                        settings, body, report, "\n\n".join(tables), notes=report["notes"],
                        log=log)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    common.add_list(parser, "--parts", PARTS, PARTS)
    add("--widths", type=common.int_list, help="linear: widths d (default 768,1024,1280,1664)")
    add("--tokens", type=common.int_list, help="linear: tokens (default 8192,16384,32768,65536)")
    add("--steps", type=int, help="e2e: steps per variant (default 300)")
    common.add_common_arguments(parser, "tiny shapes and tower, 3 steps: a CPU smoke test "
                                "(do_bench warmup and rep default to 25 and 100 ms)", dtype=False)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    gc.collect()
    gc.freeze()  # common.release_memory's many gc.collect() calls then skip what exists now
    try:
        return measure(args, log)
    finally:
        gc.unfreeze()


def measure(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    device = common.run_device(args, NAME, log)
    if device is None:
        return 2
    cuda, sizes = common.uses_cuda(device), QUICK if args.quick else FULL
    s = SimpleNamespace(**{
        **sizes, "widths": args.widths or sizes["widths"], "tokens": args.tokens or sizes["tokens"],
        "steps": args.steps or sizes["steps"], "parts": [p for p in PARTS if p in args.parts],
        "backend": "triton" if cuda else "torch", "seed": args.seed, "quick": args.quick,
        "timing": common.timing_settings(args.warmup_ms, args.rep_ms, args.quick, TRITON_TIMING)})
    env = common.collect_environment(device)
    log(f"companions on {env['device_name']}, SwitchBack backend {s.backend}: {s.parts}")
    report = {"suite": NAME, "environment": env,
              "settings": {**vars(s), "model": vars(s.model), "timing": asdict(s.timing)},
              "matmul": common.probe_matmul(device, s.quick, s.timing, torch.bfloat16, log),
              "timing": common.timing_text(device, s.timing),
              "notes": [common.QUICK_NOTE] if s.quick else []}
    if "linear" in s.parts:
        report["linear"] = run_linear(s, device, log)
    if "optimizer" in s.parts:
        report["optimizer"] = run_optimizer(s, device)
    if "e2e" in s.parts:
        rows = report["e2e"] = [train(provider, s, device) for provider in E2E_PROVIDERS]
        for row in rows:  # rows[0]: nn.Linear
            if row["final_loss"] is not None and rows[0]["final_loss"] is not None:
                row["final_loss_delta"] = row["final_loss"] - rows[0]["final_loss"]
        curves = [(row["label"], range(len(row["losses"])), row["losses"]) for row in rows]
        if not common.save_plot(common.results_path(args.out, NAME, env, args.tag, ".png"), [(
                "CLIP training: loss per step", "step", "CLIP loss", curves)], linewidth=1):
            log("no plot: matplotlib is not installed")
    write_report(report, s, args, log)
    return 0


SUITE = Suite(NAME, "SwitchBack layers, StableAdamW and a CLIP training run", add_arguments, run)
