"""Suite ``sizes``: every loss against the PyTorch loss it replaces, from small sizes up."""

from __future__ import annotations

import argparse
import functools
import itertools
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
BACKENDS = {"fusedloss": "auto", "fusedloss-tiled": "triton", "fusedloss-materialized":
            "materialized"}  # the contrastive losses' backend per method (the LM head has one)
DTYPE = torch.bfloat16
CONTRASTIVE_SIZES = (128, 256, 1024, 4096, 16384, 65536, 262144)
LM_SIZES = (256, 512, 2048, 8192, 32768, 131072, 262144)


@dataclass(frozen=True)
class Loss:
    name: str
    width: int  # c, or the LM head's D
    vocab: int = 0  # the LM head's V (0: a contrastive loss)
    softcap: float | None = None


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
    a, b = (F.normalize(torch.randn(size, loss.width, device=device, generator=g), dim=1)
            for _ in range(2))
    return dict(a=a.to(dtype).requires_grad_(), b=b.to(dtype).requires_grad_())


def fused(loss: Loss, x: dict[str, Any], backend: str = "auto") -> torch.Tensor:
    """fusedloss's loss (``backend``: the contrastive losses' path, :data:`BACKENDS`)."""
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
    z, n = torch.cat([a, b]), a.shape[0]
    sim = (z @ z.T / 0.5).float()
    sim = sim.masked_fill(torch.eye(2 * n, device=z.device, dtype=torch.bool), float("-inf"))
    return F.cross_entropy(sim, torch.cat([rows + n, rows]))


_COMPILED: dict[str, Any] = {}


def measure(loss: Loss, size: int, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """One method's forward + backward: loss value, median ms, the host µs to issue one call
    with the GPU idle (not waiting for it), peak MiB."""
    x = make_inputs(loss, size, DTYPE, args.device)
    leaves = [t for t in x.values() if t.requires_grad]
    if method == "torch-compile" and loss.name not in _COMPILED:
        # one graph for every size (dynamic shapes): a compile per size would take minutes
        _COMPILED[loss.name] = torch.compile(functools.partial(materialized, loss), dynamic=True)
    if method in BACKENDS:
        fn = functools.partial(fused, loss, x, BACKENDS[method])
    elif method == "torch-compile":
        fn = functools.partial(_COMPILED[loss.name], x)
    else:
        fn = functools.partial(materialized, loss, x)

    def step():
        for t in leaves:
            t.grad = None
        out = fn()
        out.backward()
        return out

    value = float(step().detach())
    timing = common.timing_settings(args.warmup_ms, args.rep_ms, args.quick)
    ms = common.median_ms(step, args.device, timing)
    host = []  # ~1 s of samples: a few at the large sizes, where a call takes seconds
    for _ in range(max(3, min(20, int(1000 / ms)))):
        common.synchronize(args.device)
        start = time.perf_counter()
        step()
        host.append((time.perf_counter() - start) * 1e6)
    common.synchronize(args.device)
    grads = sum(t.numel() * t.element_size() for t in leaves)
    for t in leaves:  # memory before the call without gradients; their bytes are subtracted
        t.grad = None
    mib = common.peak_extra_mib(step, args.device, accounted_bytes=grads)
    return dict(loss=loss.name, size=size, method=method, ms=ms,
                host_us=statistics.median(host), mib=mib, value=value)


# ----------------------------------------------------------------------------- training steps
STEPS = {  # a tiny model's training step with the loss inside: (rows, width, vocabulary)
    "mlp-clip": (256, 512, 0),  # a two-layer MLP encoder per tower, CLIP at b = 256
    "small-lm": (512, 512, 32000),  # a two-layer MLP body and an LM head, N = 512 tokens
}
STEP_METHODS = ("fusedloss", "torch", "fusedloss-graphed", "torch-graphed")


def step_fn(name: str, method: str, device: str, dtype: torch.dtype, quick: bool = False):
    """One SGD step of the tiny model ``name`` with fusedloss's or the materialized PyTorch
    loss ("-graphed": the loss under torch.compile(mode="reduce-overhead")); ``quick``: /16."""
    import fusedloss

    rows, width, vocab = (d // 16 if quick else d for d in STEPS[name])
    torch.manual_seed(0)
    towers = torch.nn.ModuleList([torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)
    ).to(device, dtype) for _ in range(2)])
    head = torch.nn.Parameter((torch.randn(max(vocab, 1), width) / width**0.5).to(device, dtype))
    optimizer = torch.optim.SGD([*towers.parameters(), head], lr=1e-3)
    g = torch.Generator(device=device).manual_seed(1)
    x, y = (torch.randn(rows, width, device=device, generator=g).to(dtype) for _ in range(2))
    target = torch.randint(0, max(vocab, 1), (rows,), device=device, generator=g)
    ours = method.startswith("fusedloss")

    def loss_fn(x, y, target):
        if vocab and ours:
            return fusedloss.linear_cross_entropy(towers[0](x), head, target)
        if vocab:
            return F.cross_entropy((towers[0](x) @ head.T).float(), target)
        a, b = F.normalize(towers[0](x), dim=1), F.normalize(towers[1](y), dim=1)
        if ours:
            return fusedloss.clip_loss(a, b, 14.0)
        logits, labels = (14.0 * a @ b.T).float(), torch.arange(rows, device=device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    if method.endswith("graphed"):
        loss_fn = torch.compile(loss_fn, mode="reduce-overhead")

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(x, y, target)
        loss.backward()
        optimizer.step()
        return loss

    return step


def measure_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median ms of each tiny step by each method (graphed on CUDA only)."""
    rows = []
    methods = [m for m in STEP_METHODS if common.uses_cuda(args.device) or "graphed" not in m]
    timing = common.timing_settings(args.warmup_ms, args.rep_ms, args.quick)
    for name in STEPS:
        for method in methods:
            step = step_fn(name, method, args.device, DTYPE, args.quick)
            for _ in range(3):  # compile, record and warm the graphs
                step()
            rows.append(dict(step=name, method=method, value=float(step().detach()),
                             ms=common.median_ms(step, args.device, timing)))
            print(f"{name:10s} {method:18s} {rows[-1]['ms']:8.3f} ms", flush=True)
    return rows


# ----------------------------------------------------------------------------- run, report
def run(args: argparse.Namespace) -> int:
    args.device = common.pick_device(args.device)
    env = common.collect_environment(args.device)
    rows: list[dict[str, Any]] = []
    steps = measure_steps(args) if args.steps else []
    for name in args.losses:
        loss = LOSSES[name]
        ladder = LM_SIZES if loss.vocab else CONTRASTIVE_SIZES
        sizes = args.sizes or ([s // 64 for s in ladder[:3]] if args.quick else ladder)
        if args.quick and loss.vocab:
            loss = Loss(loss.name, 32, vocab=1000, softcap=loss.softcap)
        for size, method in itertools.product(sizes, args.methods):
            if loss.vocab and method in ("fusedloss-tiled", "fusedloss-materialized"):
                continue  # the LM head has one path
            # the materialized loss only where its logits (~3 fp32 copies) fit in a quarter of
            # the free memory
            if (method not in BACKENDS and common.uses_cuda(args.device) and 3 * size
                    * (loss.vocab or size) * 4 > torch.cuda.mem_get_info(args.device)[0] // 4):
                continue
            try:
                row = measure(loss, size, method, args)
            except Exception as error:  # a method that fails (OOM) leaves a hole
                row = dict(loss=loss.name, size=size, method=method,
                           error=common.describe_error(error))
            common.release_memory(args.device)
            rows.append(row)
            print(row["loss"], row["size"], method, row.get("error") or
                  f"{row['ms']:.3f} ms, host {row['host_us']:.0f} µs, "
                  f"{common.format_mib(row['mib'])} MiB", flush=True)
    # each method's loss value within 2% of the materialized eager one (bf16 logits)
    eager = {(r["loss"], r["size"]): r["value"] for r in rows
             if r["method"] == "torch" and "value" in r}
    for r in rows:
        ref = eager.get((r["loss"], r["size"]))
        if "value" in r and ref is not None and abs(r["value"] - ref) > 0.02 * max(1, abs(ref)):
            r["wrong"] = f"loss {r['value']:.5g} vs PyTorch's {ref:.5g}"
    body, time_table = _markdown(rows, steps)
    common.write_report(args.out, "sizes", args.tag, env, "Losses against PyTorch's, by size",
                        common.environment_rows(env, {}), body,
                        dict(environment=env, rows=rows, steps=steps), time_table)
    if args.plot:
        _plot(rows, env, common.results_path(args.out, "sizes", env, args.tag, ".svg"))
    return 0


def _cell(row: dict[str, Any] | None) -> str:
    """ms / host µs / MiB of one method on one case."""
    if row is None or "error" in row:
        return "—" if row is None else "failed"
    text = f"{common.format_ms(row['ms'])} / {row['host_us']:.0f} / {common.format_mib(row['mib'])}"
    return text + (" (wrong)" if "wrong" in row else "")


def _ratio(got: dict[str, dict[str, Any]]) -> str:
    """fusedloss's ms ÷ the best of PyTorch eager and compiled."""
    ours = got.get("fusedloss", {}).get("ms")
    theirs = [got[m]["ms"] for m in ("torch", "torch-compile") if "ms" in got.get(m, {})]
    return f"{ours / min(theirs):.2f}×" if ours and theirs else "—"


def _markdown(rows: list[dict[str, Any]], steps: list[dict[str, Any]]) -> tuple[list[str], str]:
    """The report's body, and its time table alone (for the terminal)."""
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    by_case: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        by_case.setdefault((r["loss"], r["size"]), {})[r["method"]] = r
    time_table = common.table([
        ("loss", lambda c: c[0][0]), ("size", lambda c: c[0][1]),
        *((m, lambda c, m=m: _cell(c[1].get(m))) for m in methods),
        ("fusedloss ÷ best PyTorch", lambda c: _ratio(c[1]))], sorted(by_case.items()))
    out = ["Forward + backward of the mean loss; median ms (do_bench) / host µs to issue one "
           "call / peak MiB above inputs and gradients. 'torch' is the materialized loss "
           "(logits in the input dtype), eager and compiled.",
           "", "## Time", "", time_table]
    if steps:
        step_ms = {(r["step"], r["method"]): r["ms"] for r in steps}
        out += ["", "## Tiny training steps", "",
                "One SGD step of a tiny model with the loss inside (`STEPS` in "
                "`benchmarks/suites/sizes.py`), median ms; 'graphed': the loss function under "
                "`torch.compile(mode=\"reduce-overhead\")` (CUDA graphs).", "",
                common.table([("step", lambda name: name), *(
                    (m, lambda name, m=m: common.format_ms(step_ms.get((name, m))))
                    for m in STEP_METHODS)], STEPS)]
    return [*out, ""], time_table


def _plot(rows: list[dict[str, Any]], env: dict[str, Any], path: Path) -> Path | None:
    """ms against size, log-log, a panel per loss and a line per method."""
    styles = dict(zip(METHODS, ("o-", "d-.", "v-.", "s--", "^:"), strict=True))
    panels = []
    for loss in dict.fromkeys(r["loss"] for r in rows):
        lines = []
        for method, style in styles.items():
            points = sorted((r["size"], r["ms"]) for r in rows
                            if r["loss"] == loss and r["method"] == method and "ms" in r)
            lines += [(method, [size for size, _ in points], [ms for _, ms in points],
                       {"marker": style[0], "linestyle": style[1:]})] if points else []
        panels.append((loss, "size (rows)", "ms, forward + backward", lines))
    return common.save_plot(path, panels, columns=len(panels), size=(3.2, 3.2), log="xy",
                            title=f"{env['device_name']}, torch {env['torch']}, triton "
                            f"{env['triton']}, {env['date']}", markersize=3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    common.add_list(parser, "--losses", LOSSES, LOSSES)
    add("--sizes", type=common.int_list, default=None,
        help="rows (b, or the LM head's N); default: each loss's ladder")
    common.add_list(parser, "--methods", METHODS, DEFAULT_METHODS)
    common.add_common_arguments(parser, "sizes/64, a small LM head, short timing: a smoke test",
                                dtype=False, seed=False)
    add("--plot", action="store_true", help="also write <results>.svg")
    add("--steps", action="store_true",
        help="also time tiny training steps with each loss (graphed on CUDA)")


SUITE = Suite("sizes", "every loss against the PyTorch loss it replaces, eager and compiled, "
              "from small sizes up", add_arguments, run)
