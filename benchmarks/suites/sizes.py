"""Suite ``sizes``: every loss against the PyTorch loss it replaces, from small sizes up.

Per loss and size (bf16): forward + backward of the mean loss by fusedloss and by the
materialized PyTorch loss (logits in the input dtype) eager and compiled; median ms, peak memory
above inputs and gradients, and the host time to issue one call with the GPU idle. The
materialized loss runs where its logits take at most a quarter of the free memory. ``--plot``
draws ms against size; ``--steps`` also times a tiny model's training step with each loss,
eager and (CUDA) under ``torch.compile(mode="reduce-overhead")``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import common
from benchmarks.suites import Suite

METHODS = ("fusedloss", "fusedloss-tiled", "fusedloss-materialized", "torch", "torch-compile")
DEFAULT_METHODS = ("fusedloss", "torch", "torch-compile")
DTYPE = torch.bfloat16
CONTRASTIVE_SIZES = (128, 256, 1024, 4096, 16384, 65536, 262144)
LM_SIZES = (256, 512, 2048, 8192, 32768, 131072, 262144)


@dataclass(frozen=True)
class Loss:
    """One loss: its inputs at a size, and its value by each method."""

    name: str
    width: int  # c, or the LM head's D
    vocab: int = 0  # the LM head's V (0: a contrastive loss)
    softcap: float | None = None

    @property
    def sizes(self) -> tuple[int, ...]:
        return LM_SIZES if self.vocab else CONTRASTIVE_SIZES

    def logits_bytes(self, size: int, element: int) -> int:
        return size * (self.vocab or size) * element


LOSSES = {loss.name: loss for loss in (
    Loss("clip", 512), Loss("siglip", 512), Loss("info-nce", 512), Loss("nt-xent", 512),
    Loss("lm-llama3", 2048, vocab=128256), Loss("lm-gemma2", 2304, vocab=256000, softcap=30.0),
)}


def make_inputs(loss: Loss, size: int, dtype: torch.dtype, device: str) -> dict[str, Any]:
    """Leaves that require gradients (and the targets), seeded, never zeros."""
    g = torch.Generator(device=device).manual_seed(0)
    if loss.vocab:
        h = torch.randn(size, loss.width, device=device, generator=g)
        w = torch.randn(loss.vocab, loss.width, device=device, generator=g) / loss.width**0.5
        y = torch.randint(0, loss.vocab, (size,), device=device, generator=g)
        return dict(h=h.to(dtype).requires_grad_(), w=w.to(dtype).requires_grad_(), y=y)

    def unit():
        x = torch.randn(size, loss.width, device=device, generator=g)
        return F.normalize(x, dim=1).to(dtype).requires_grad_()

    return dict(a=unit(), b=unit())


def fused(loss: Loss, x: dict[str, Any], backend: str = "auto") -> torch.Tensor:
    """fusedloss's loss; ``backend`` for the contrastive ones ("triton": the tiled kernels
    whatever the size, the "fusedloss-tiled" method; "materialized": the one-launch kernels
    over the whole similarity matrix, the "fusedloss-materialized" method)."""
    import fusedloss

    if loss.vocab:
        return fusedloss.linear_cross_entropy(x["h"], x["w"], x["y"], softcap=loss.softcap)
    if loss.name == "clip":
        return fusedloss.clip_loss(x["a"], x["b"], 14.0, backend=backend)
    if loss.name == "siglip":
        return fusedloss.siglip_loss(x["a"], x["b"], 10.0, -10.0, backend=backend)
    if loss.name == "info-nce":
        return fusedloss.info_nce_loss(x["a"], x["b"], temperature=0.07, backend=backend)
    return fusedloss.nt_xent_loss(torch.cat([x["a"], x["b"]]), temperature=0.5,
                                  backend=backend)


def materialized(loss: Loss, x: dict[str, Any]) -> torch.Tensor:
    """The loss as PyTorch users write it: the logits in the input dtype, F.cross_entropy."""
    if loss.vocab:
        logits = x["h"] @ x["w"].T
        if loss.softcap:
            logits = loss.softcap * torch.tanh(logits / loss.softcap)
        return F.cross_entropy(logits.float(), x["y"])
    a, b = x["a"], x["b"]
    rows = torch.arange(a.shape[0], device=a.device)
    if loss.name == "clip":
        logits = 14.0 * a @ b.T
        return (F.cross_entropy(logits, rows) + F.cross_entropy(logits.T, rows)) / 2
    if loss.name == "siglip":
        logits = 10.0 * a @ b.T - 10.0
        labels = 2 * torch.eye(a.shape[0], device=a.device, dtype=logits.dtype) - 1
        return -F.logsigmoid(labels * logits).sum() / a.shape[0]
    if loss.name == "info-nce":
        return F.cross_entropy(a @ b.T / 0.07, rows)
    z = torch.cat([a, b])
    n = a.shape[0]
    sim = (z @ z.T / 0.5).float()
    sim = sim.masked_fill(torch.eye(2 * n, device=z.device, dtype=torch.bool), float("-inf"))
    return F.cross_entropy(sim, torch.cat([rows + n, rows]))


def host_us(step, device: str, reps: int = 20) -> float:
    """Median wall time to issue one call with the GPU idle, not waiting for it."""
    samples = []
    for _ in range(reps):
        common.synchronize(device)
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e6)
    common.synchronize(device)
    return statistics.median(samples)


_COMPILED: dict[str, Any] = {}


def measure(loss: Loss, size: int, method: str, args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    x = make_inputs(loss, size, DTYPE, device)
    leaves = [t for t in x.values() if t.requires_grad]
    if method == "torch-compile" and loss.name not in _COMPILED:
        # one graph for every size (dynamic shapes): a compile per size would take minutes
        _COMPILED[loss.name] = torch.compile(functools.partial(materialized, loss), dynamic=True)
    fn = {"fusedloss": lambda: fused(loss, x),
          "fusedloss-tiled": lambda: fused(loss, x, "triton"),
          "fusedloss-materialized": lambda: fused(loss, x, "materialized"),
          "torch": lambda: materialized(loss, x),
          "torch-compile": lambda: _COMPILED[loss.name](x)}[method]

    def step():
        out = fn()
        out.backward()
        return out

    def clear():
        for t in leaves:
            t.grad = None

    value = float(step().detach())
    clear()
    timing = common.timing_settings(args.warmup_ms, args.rep_ms, args.quick)
    ms = common.median_ms(lambda: (clear(), step()), device, timing)
    # ~1 s of host samples: a few at the large sizes, where a call takes seconds
    host = host_us(lambda: (clear(), step()), device, reps=max(3, min(20, int(1000 / ms))))
    grads = sum(t.numel() * t.element_size() for t in leaves)
    clear()
    mib = common.peak_extra_mib(step, device, accounted_bytes=grads)
    return dict(loss=loss.name, size=size, method=method, ms=ms, host_us=host, mib=mib,
                value=value)


def fits(loss: Loss, size: int, method: str, args: argparse.Namespace) -> bool:
    if method.startswith("fusedloss") or not common.uses_cuda(args.device):
        return True
    free, _ = torch.cuda.mem_get_info(args.device)
    # logits, their fp32 copy and gradient: about 3 fp32 copies
    return 3 * loss.logits_bytes(size, 4) <= free // 4


# ----------------------------------------------------------------------------- training steps

STEPS = {  # a tiny model's training step with the loss inside: (rows, width, vocabulary)
    "mlp-clip": (256, 512, 0),  # a two-layer MLP encoder per tower, CLIP at b = 256
    "small-lm": (512, 512, 32000),  # a two-layer MLP body and an LM head, N = 512 tokens
}


def step_fn(name: str, method: str, device: str, dtype: torch.dtype, quick: bool = False):
    """One optimizer step of the tiny model ``name`` whose loss is fusedloss's or the
    materialized PyTorch one (``quick``: every dimension / 16)."""
    import fusedloss

    rows, width, vocab = (d // 16 if quick else d for d in STEPS[name])
    torch.manual_seed(0)

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                   torch.nn.Linear(width, width)).to(device, dtype)

    towers = torch.nn.ModuleList([mlp(), mlp()])
    head = torch.nn.Parameter((torch.randn(max(vocab, 1), width) / width**0.5).to(device, dtype))
    params = [*towers.parameters(), head]
    opt = torch.optim.SGD(params, lr=1e-3)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, width, device=device, generator=g).to(dtype)
    y = torch.randn(rows, width, device=device, generator=g).to(dtype)
    target = torch.randint(0, max(vocab, 1), (rows,), device=device, generator=g)
    ours = method.startswith("fusedloss")

    def loss_fn(x, y, target):
        if vocab:
            h = towers[0](x)
            if ours:
                return fusedloss.linear_cross_entropy(h, head, target)
            return F.cross_entropy((h @ head.T).float(), target)
        a, b = F.normalize(towers[0](x), dim=1), F.normalize(towers[1](y), dim=1)
        if ours:
            return fusedloss.clip_loss(a, b, 14.0)
        logits, labels = 14.0 * a @ b.T, torch.arange(rows, device=device)
        return (F.cross_entropy(logits.float(), labels)
                + F.cross_entropy(logits.T.float(), labels)) / 2

    if method.endswith("graphed"):
        loss_fn = torch.compile(loss_fn, mode="reduce-overhead")

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(x, y, target)
        loss.backward()
        opt.step()
        return loss

    return step


STEP_METHODS = ("fusedloss", "torch", "fusedloss-graphed", "torch-graphed")


def measure_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each tiny step by each method: median ms of one step (the GPU waits on the host for
    steps this small, so this is the host's time too)."""
    rows = []
    methods = [m for m in STEP_METHODS if common.uses_cuda(args.device) or "graphed" not in m]
    timing = common.timing_settings(args.warmup_ms, args.rep_ms, args.quick)
    for name in STEPS:
        for method in methods:
            step = step_fn(name, method, args.device, DTYPE, args.quick)
            for _ in range(3):  # compile, record and warm the graphs
                step()
            row = dict(step=name, method=method, value=float(step().detach()),
                       ms=common.median_ms(step, args.device, timing))
            rows.append(row)
            print(f"{name:10s} {method:18s} {row['ms']:8.3f} ms", flush=True)
    return rows


def run(args: argparse.Namespace) -> int:
    env = common.collect_environment(args.device)
    rows: list[dict[str, Any]] = []
    steps = measure_steps(args) if args.steps else []
    for name in args.losses:
        loss = LOSSES[name]
        sizes = args.sizes or ([s // 64 for s in loss.sizes[:3]] if args.quick else loss.sizes)
        if args.quick and loss.vocab:
            loss = Loss(loss.name, 32, vocab=1000, softcap=loss.softcap)
        for size in sizes:
            for method in args.methods:
                if method in ("fusedloss-tiled", "fusedloss-materialized") and loss.vocab:
                    continue  # the LM head has one path
                if not fits(loss, size, method, args):
                    continue
                try:
                    row = measure(loss, size, method, args)
                except Exception as error:  # a method that fails (OOM) leaves a hole
                    row = dict(loss=loss.name, size=size, method=method,
                               error=common.describe_error(error))
                common.release_memory(args.device)
                rows.append(row)
                print(_line(row), flush=True)
    _check_values(rows)
    stem = common.results_stem("sizes", env["date"], env["device_slug"], args.tag)
    markdown = _markdown(env, rows, steps)
    common.write_results(args.out, stem, markdown, dict(environment=env, rows=rows,
                                                        steps=steps))
    if args.plot:
        _plot(rows, env, Path(args.out) / f"{stem}.svg")
    print(markdown.split("## Time")[1] if "## Time" in markdown else markdown)
    return 0


def _check_values(rows: list[dict[str, Any]]) -> None:
    """Each method's loss value within 2% of the materialized eager one (bf16 logits)."""
    by_case = {(r["loss"], r["size"]): r["value"] for r in rows
               if r["method"] == "torch" and "value" in r}
    for r in rows:
        ref = by_case.get((r["loss"], r["size"]))
        if "value" in r and ref is not None and abs(r["value"] - ref) > 0.02 * max(1, abs(ref)):
            r["wrong"] = f"loss {r['value']:.5g} vs PyTorch's {ref:.5g}"


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['loss']:10s} {row['size']:>7d} {row['method']:14s} failed: {row['error']}"
    return (f"{row['loss']:10s} {row['size']:>7d} {row['method']:14s} {row['ms']:9.3f} ms  "
            f"host {row['host_us']:7.0f} µs  {common.format_mib(row['mib'])} MiB")


def _markdown(env: dict[str, Any], rows: list[dict[str, Any]],
              steps: list[dict[str, Any]]) -> str:
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    out = [f"# Losses against PyTorch's, by size: {env['device_name']}, {env['date']}", "",
           f"torch {env['torch']}, triton {env['triton']}, fusedloss {env['fusedloss_version']} "
           f"({env['fusedloss_revision']}). Forward + backward of the mean loss; median ms "
           "(do_bench) / host µs to issue one call / peak MiB above inputs and gradients. "
           "'torch' is the materialized loss (logits in the input dtype), eager and compiled.",
           "", "## Time", ""]
    header = "| loss | size | " + " | ".join(methods) + " | fusedloss ÷ best PyTorch |"
    out += [header, "|" + "---|" * (len(methods) + 3)]
    cases = sorted({(r["loss"], r["size"]) for r in rows}, key=lambda c: (c[0], c[1]))
    for loss, size in cases:
        got = {r["method"]: r for r in rows if (r["loss"], r["size"]) == (loss, size)}
        cells = []
        for m in methods:
            r = got.get(m)
            if r is None or "error" in r:
                cells.append("—" if r is None else "failed")
            else:
                cells.append(f"{common.format_ms(r['ms'])} / {r['host_us']:.0f} / "
                             f"{common.format_mib(r['mib'])}" + (" (wrong)" if "wrong" in r
                                                                   else ""))
        ours = got.get("fusedloss", {}).get("ms")
        theirs = [got[m]["ms"] for m in ("torch", "torch-compile") if "ms" in got.get(m, {})]
        ratio = f"{ours / min(theirs):.2f}×" if ours and theirs else "—"
        out.append(f"| {loss} | {size} | " + " | ".join(cells) + f" | {ratio} |")
    if steps:
        out += ["", "## Tiny training steps", "",
                "One SGD step of a tiny model with the loss inside (`STEPS` in "
                "`benchmarks/suites/sizes.py`), median ms; 'graphed': the loss function under "
                "`torch.compile(mode=\"reduce-overhead\")` (CUDA graphs).", "",
                "| step | " + " | ".join(STEP_METHODS) + " |", "|" + "---|" * 5]
        for name in STEPS:
            got = {r["method"]: r["ms"] for r in steps if r["step"] == name}
            out.append(f"| {name} | " + " | ".join(common.format_ms(got.get(m))
                                                    for m in STEP_METHODS) + " |")
    return "\n".join(out) + "\n"


def _plot(rows: list[dict[str, Any]], env: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = list(dict.fromkeys(r["loss"] for r in rows))
    fig, axes = plt.subplots(1, len(losses), figsize=(3.2 * len(losses), 3.2), squeeze=False)
    for ax, loss in zip(axes[0], losses, strict=True):
        for method, style in zip(METHODS, ("o-", "d-.", "v-.", "s--", "^:"), strict=True):
            pts = sorted((r["size"], r["ms"]) for r in rows
                         if r["loss"] == loss and r["method"] == method and "ms" in r)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=method, markersize=3)
        ax.set(xscale="log", yscale="log", title=loss, xlabel="size (rows)")
    axes[0][0].set_ylabel("ms, forward + backward")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{env['device_name']}, torch {env['torch']}, triton {env['triton']}, "
                 f"{env['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--losses", type=common.comma_list(list(LOSSES)), default=list(LOSSES),
                        help=f"comma list of {', '.join(LOSSES)} (default: all)")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="rows (b, or the LM head's N); default: each loss's ladder")
    parser.add_argument("--methods", type=common.comma_list(list(METHODS)),
                        default=list(DEFAULT_METHODS),
                        help=f"comma list of {', '.join(METHODS)} (default: "
                             f"{','.join(DEFAULT_METHODS)}; fusedloss-tiled and "
                             "fusedloss-materialized: the contrastive losses on their tiled "
                             "or on their materialized kernels at every size)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup-ms", type=float, default=None)
    parser.add_argument("--rep-ms", type=float, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="sizes/64, a small LM head, short timing: a smoke test")
    parser.add_argument("--plot", action="store_true", help="also write <results>.svg")
    parser.add_argument("--steps", action="store_true",
                        help="also time tiny training steps with each loss (graphed on CUDA)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default=None)


SUITE = Suite("sizes", "every loss against the PyTorch loss it replaces, eager and compiled, "
              "from small sizes up", add_arguments, run)
