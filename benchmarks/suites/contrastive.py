"""Suite ``contrastive``: CLIP, InfoNCE, NT-Xent and SigLIP losses, ours against PyTorch and
inf-cl and against the cuBLAS products of the same shapes; ``--plot`` draws ms against b."""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks import common
from benchmarks import inputs as pairs
from benchmarks import providers as prov
from benchmarks.common import Column, TimingSettings
from benchmarks.providers import CLIP, INFO_NCE, NT_XENT, SIGLIP, Provider
from benchmarks.suites import Suite

NAME = "contrastive"
FUSEDLOSS, FUSEDLOSS_COMPILE, TORCH, INF_CL = "fusedloss", "fusedloss-compile", "torch", "inf-cl"
PROVIDER_KEYS = (FUSEDLOSS, FUSEDLOSS_COMPILE, TORCH, INF_CL)
DEFAULT_PROVIDERS = (FUSEDLOSS, TORCH, INF_CL)  # fusedloss-compile on request

SIGLIP_LOGIT_SCALE, SIGLIP_LOGIT_BIAS = 10.0, -10.0  # SigLIP's initialization
NT_XENT_TEMPERATURE = 0.5  # SimCLR's large-batch temperature
INFO_NCE_TEMPERATURE = 0.05  # sentence-transformers' scale 20

# The check: |loss − ref| ≤ LOSS_TOLERANCE·max(1, |ref|), relative L2 gradient errors ≤ bounds.
LOSS_TOLERANCE = 1e-2
GRADIENT_ERROR_BOUND = 5e-2  # feature gradients
SCALAR_ERROR_BOUND = 0.5  # d logit_scale, d logit_bias: sums that cancel
# Reference: float64 with gradients while rows²·c ≤ 2^40, a float32 loss up to 262144 rows.
REFERENCE_GRADS_MAX_WORK = 1 << 40
REFERENCE_LOSS_MAX_ROWS = 262_144
# Calls of ≥ SLOW_MS are timed one by one, clamp(SLOW_BUDGET_MS / call, 2, SLOW_MAX_REPS) times.
SLOW_MS, SLOW_BUDGET_MS, SLOW_MAX_REPS = 500.0, 10_000.0, 3

MEMORY_DEFINITION = (
    "peak MB above inputs and gradient buffers = (torch.cuda.max_memory_allocated() during "
    "one forward+backward call − memory_allocated() just before it − the gradients' bytes) "
    "/ 2^20; allocator cache emptied and peak counter reset right before the call"
)
GRAD_NAMES = {CLIP: ("dI", "dT", "ds"), NT_XENT: ("dZ",), SIGLIP: ("dI", "dT", "ds", "db"),
              INFO_NCE: ("dQ", "dK")}
_OURS, _BOTH = (FUSEDLOSS, FUSEDLOSS_COMPILE), ("random", "trained")
SHAPES = {  # name: (loss, rows b or 2B for NT-Xent, width c, default regimes, its providers)
    "clip-16k": (CLIP, 16_384, 512, _BOTH, PROVIDER_KEYS),
    "siglip-16k": (SIGLIP, 16_384, 512, ("random",), (*_OURS, TORCH)),
    "siglip-64k": (SIGLIP, 65_536, 512, ("random",), _OURS),
    "nt-xent-64k": (NT_XENT, 65_536, 256, _BOTH, (*_OURS, TORCH)),
    "clip-64k": (CLIP, 65_536, 512, _BOTH, PROVIDER_KEYS),
    "clip-128k": (CLIP, 131_072, 768, _BOTH, PROVIDER_KEYS),
    "clip-256k": (CLIP, 262_144, 512, _BOTH, _OURS),
    "clip-1m": (CLIP, 1_048_576, 512, ("random",), _OURS),
    "info-nce-16k": (INFO_NCE, 16_384, 512, ("random",), (*_OURS, TORCH)),
    "info-nce-64k": (INFO_NCE, 65_536, 512, ("random",), _OURS),
}
# --losses/--rows/--widths: a grid of cases instead of the named shapes, every provider.
GRID_LOSSES = (CLIP, INFO_NCE, NT_XENT, SIGLIP)
QUICK_ROWS_DIVISOR, QUICK_WIDTH_DIVISOR = 256, 8  # --quick: clip-1m → 4096 × 64, runs on CPU


@dataclass(frozen=True)
class Case:
    shape: str
    loss: str
    rows: int  # b, or 2B for NT-Xent
    width: int  # c
    regime: str
    providers: tuple[str, ...]  # those that run on it (when selected)

    @property
    def label(self) -> str:
        size = f"2×{self.rows // 2}" if self.loss == NT_XENT else f"{self.rows}"
        return f"{self.loss} {size}×{self.width} {self.regime}"

    @property
    def parameters(self) -> dict[str, float]:
        """The loss's arguments after the features."""
        if self.loss == CLIP:
            return {"logit_scale": pairs.pair_logit_scale(self.regime)}
        if self.loss == SIGLIP:
            return {"logit_scale": SIGLIP_LOGIT_SCALE, "logit_bias": SIGLIP_LOGIT_BIAS}
        if self.loss == INFO_NCE:
            return {"temperature": INFO_NCE_TEMPERATURE}
        return {"temperature": NT_XENT_TEMPERATURE}

    @property
    def logit_products(self) -> int:  # SigLIP's backward reuses the forward's tile
        return 1 if self.loss == SIGLIP else 2

    def floor_ms(self, tflops: float) -> float:
        """The one-pass cost floor 8·r²·c/R (docs/design.md); half of it with reuse."""
        return 8.0 * self.rows**2 * self.width / (tflops * 1e12) * 1e3

    @property
    def reference_dtype(self) -> torch.dtype | None:
        """float64 with gradients, a float32 loss only, or no reference (by size)."""
        if self.rows**2 * self.width <= REFERENCE_GRADS_MAX_WORK:
            return torch.float64
        return torch.float32 if self.rows <= REFERENCE_LOSS_MAX_ROWS else None


def select_cases(shapes: Sequence[str] | None, regimes: Sequence[str] | None,
                 quick: bool, grid: tuple[Sequence[str], Sequence[int], Sequence[int]] | None = None
                 ) -> list[Case]:
    """Every chosen shape (default: all) × the chosen regimes (default: the shape's own); with
    ``grid`` (losses, rows, widths) every combination instead, random features by default."""
    table = SHAPES
    if grid:
        losses, all_rows, widths = grid
        table = {f"{loss}-{rows}x{width}": (loss, rows, width, ("random",), PROVIDER_KEYS)
                 for loss in losses for rows in all_rows for width in widths}
    cases = []
    for name in (table if grid else shapes or SHAPES):
        loss, rows, width, default_regimes, providers = table[name]
        if quick:
            rows = max(16, rows // QUICK_ROWS_DIVISOR)
            rows, width = rows - rows % 2, max(16, width // QUICK_WIDTH_DIVISOR)
        cases += [Case(name, loss, rows, width, regime, providers)
                  for regime in regimes or default_regimes]
    return cases


def make_case_inputs(case: Case, *, dtype: torch.dtype, device: torch.device,
                     seed: int) -> tuple[Any, ...]:
    """The loss's arguments: features of the case's regime, then its parameters (tensors
    but τ); every tensor requires grad (the leaves, in :data:`GRAD_NAMES` order)."""
    rows = case.rows // 2 if case.loss == NT_XENT else case.rows
    image, text = pairs.make_pair_features(rows, case.width, case.regime, dtype=dtype,
                                           device=device, seed=seed)
    if case.loss == NT_XENT:
        return torch.cat([image, text]).requires_grad_(True), NT_XENT_TEMPERATURE
    if case.loss == INFO_NCE:
        return image.requires_grad_(True), text.requires_grad_(True), INFO_NCE_TEMPERATURE
    return (image.requires_grad_(True), text.requires_grad_(True), *(
        torch.tensor(v, dtype=torch.float32, device=device, requires_grad=True)
        for v in case.parameters.values()))


@dataclass
class Reference:
    loss: float
    dtype: str  # "float64" or "fp32 (TF32 products)"
    directions: tuple[float, float] | None = None  # CLIP: image→text, text→image
    grads: dict[str, Tensor] | None = None


def contrastive_reference(loss: str, args: Sequence[Any], *, with_grads: bool,
                          dtype: torch.dtype = torch.float64, rows_per_chunk: int = 0
                          ) -> Reference:
    """The mean loss (and gradients) of ``args`` (as the providers take them) in ``dtype``, a
    block of ``rows_per_chunk`` logit rows at a time (default: ≤ 256 MiB, ≤ 4096 rows); fp32 for
    bf16/fp16 inputs uses TF32 products (exact for them). Gradients: autograd through each
    block, CLIP's column log-sum-exps taken from a first pass (∂lse_j/∂X_ij = exp(X_ij − lse_j))."""
    device = args[0].device
    features = args[:1] if loss == NT_XENT else args[:2]
    values = [torch.as_tensor(v).item() for v in args[len(features):]]  # NT-Xent: scale 1/τ
    values = [1.0 / values[0]] if loss in (NT_XENT, INFO_NCE) else values
    tensors = [t.detach().to(dtype).requires_grad_(with_grads) for t in features] + [
        torch.tensor(v, dtype=dtype, device=device, requires_grad=with_grads) for v in values]
    a, b, scale = tensors[0], tensors[len(features) - 1], tensors[len(features)]
    n = a.shape[0]
    chunk = rows_per_chunk or max(1, min(4096, (256 << 20) // (a.element_size() * n)))
    starts = range(0, n, chunk)

    def logits(start: int) -> Tensor:
        x = a[start : start + chunk] @ b.T * scale
        return x + tensors[3] if loss == SIGLIP else x

    def sums() -> tuple[float, float, Tensor | None]:
        """Σ row log-sum-exps (SigLIP: Σ softplus terms), Σ target logits, column lse."""
        column_lse = None
        if loss == CLIP:
            column_lse = torch.full((n,), -math.inf, dtype=dtype, device=device)
            with torch.no_grad():
                for start in starts:
                    column_lse = torch.logaddexp(column_lse, torch.logsumexp(logits(start), 0))
        row_total = target_total = 0.0
        for start in starts:
            x = logits(start)
            local = torch.arange(x.shape[0], device=device)
            diagonal = (local, local + start)
            target = torch.zeros((), dtype=dtype, device=device)
            if loss == SIGLIP:  # labels +1 on the diagonal, −1 elsewhere
                total = F.softplus(x).sum() - F.softplus(x[diagonal]).sum()
                total = objective = total + F.softplus(-x[diagonal]).sum()
            else:
                if loss == NT_XENT:
                    x[diagonal] = -math.inf
                targets = (local + start + n // 2) % n if loss == NT_XENT else local + start
                target = x[local, targets].sum()
                total = torch.logsumexp(x, 1).sum()
                objective = total - target
                if loss == CLIP:
                    objective = (objective + (x - column_lse).exp().sum() - target) / 2
            if with_grads:
                (objective / n).backward()
            row_total += total.item()
            target_total += target.item()
        return row_total, target_total, column_lse

    tf32 = dtype == torch.float32 and args[0].dtype in (torch.bfloat16, torch.float16)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else previous)
    try:
        with torch.set_grad_enabled(with_grads):
            row_total, target_total, column_lse = sums()
    finally:
        torch.set_float32_matmul_precision(previous)
    value, directions = (row_total - target_total) / n, None
    if loss == CLIP:
        directions = (value, (float(column_lse.sum()) - target_total) / n)
        value = sum(directions) / 2
    grads = None
    if with_grads:
        leaves = tensors[: len(GRAD_NAMES[loss])]
        grads = {name: t.grad for name, t in zip(GRAD_NAMES[loss], leaves, strict=True)}
    name = "float64" if dtype == torch.float64 else common.dtype_name(dtype)
    return Reference(value, name + (" (TF32 products)" if tf32 else ""), directions, grads)


@dataclass
class CaseResult:
    case: Case
    floor_ms: float
    reference: Reference | None  # none above REFERENCE_LOSS_MAX_ROWS: the loss checked finite
    results: dict[str, common.Row] = field(default_factory=dict)
    products: dict[str, Any] = field(default_factory=dict)  # common.time_products()


def run_provider(provider: Provider, case: Case, args: Sequence[Any],
                 reference: Reference | None, *, timing: TimingSettings,
                 floor_ms: float) -> common.Row:
    """Check, measure memory, and time one provider on one case; never raises."""
    device, inputs = args[0].device, tuple(a for a in args if isinstance(a, Tensor))
    row = common.new_row(provider.key, provider.display_name(), timing="", peak_extra_mib=None,
                         loss=None, loss_error=None, errors={}, ratios={}, times_floor=None)
    ok, loss_fn = common.stage(row, lambda: provider.build(device, case.loss), device)
    if not ok:
        return row
    row["call"] = provider.describe(case.loss)

    def forward_backward() -> tuple[Tensor, ...]:
        return torch.autograd.grad(loss_fn(*args), inputs)

    def timer(step: Callable[[], Any], last_ms: float) -> dict[str, Any]:
        if last_ms < SLOW_MS:
            how = "do_bench" if common.uses_cuda(device) else "wall-clock median"
            return {"ms": common.median_ms(step, device, timing), "timing": how}
        reps = max(2, min(SLOW_MAX_REPS, int(SLOW_BUDGET_MS // last_ms)))  # do_bench: ≥ 8 calls
        return {"ms": statistics.median(common.timed(step, device)[0] for _ in range(reps)),
                "timing": f"median of {reps} timed calls"}

    def check() -> list[str]:  # finite loss and gradients, compared with the reference
        loss = loss_fn(*args)
        grads = dict(zip(GRAD_NAMES[case.loss], torch.autograd.grad(loss, inputs), strict=True))
        row["loss"] = float(loss.detach().float())
        problems = [] if math.isfinite(row["loss"]) else [f"loss {row['loss']}"]
        problems += [f"{name} not finite" for name, g in grads.items()
                     if not torch.isfinite(g).all()]
        if reference is not None:
            row["loss_error"], found = common.check_loss(row["loss"], reference.loss,
                                                         LOSS_TOLERANCE)
            problems += found
        if reference is not None and reference.grads is not None:
            row["errors"] = {name: common.relative_l2_error(grad, reference.grads[name])
                             for name, grad in grads.items()}
            problems += common.bound_problems(row["errors"], lambda name: (
                GRADIENT_ERROR_BOUND if grads[name].dim() else SCALAR_ERROR_BOUND))
        return problems

    if common.check_and_time(row, device, check, forward_backward, common.tensor_bytes(inputs),
                             timer):
        row["times_floor"] = row["ms"] / floor_ms
    return row


def run_cases(cases: Sequence[Case], providers: Sequence[Provider], *,
              device: torch.device, dtype: torch.dtype, seed: int, timing: TimingSettings,
              tflops: float, log: Callable[[str], None] = print) -> list[CaseResult]:
    """Run every provider of every case (the case's providers among those selected)."""
    case_results = []
    for case in cases:
        args = make_case_inputs(case, dtype=dtype, device=device, seed=seed)
        ref_dtype = case.reference_dtype
        reference = ref_dtype and contrastive_reference(
            case.loss, args, with_grads=ref_dtype == torch.float64, dtype=ref_dtype)
        cr = CaseResult(case, case.floor_ms(tflops), reference)
        case_results.append(cr)
        common.release_memory(device)
        features = [t for t in args if isinstance(t, Tensor)][:2]
        cr.products = common.time_products(features[0], features[-1], timing,
                                           logit_products=case.logit_products)
        log(f"[{case.label}] {case.parameters}: reference loss {_loss_text(cr)}, products "
            f"{common.format_ms(cr.products['ms'])} ms {cr.products['note']}".rstrip())
        for provider in providers:
            if provider.key not in case.providers or not provider.supports(case.loss):
                continue
            result = cr.results[provider.key] = run_provider(
                provider, case, args, cr.reference, timing=timing, floor_ms=cr.floor_ms)
            log(f"  {case.label:<22} {result['label']:<20} " + common.progress_line(
                result, lambda r: f"{common.format_ms(r['ms'])} ms ({r['timing']}), "
                f"{common.format_mib(r['peak_extra_mib'])} MB, {common.errors_text(r)}"))
        for result in cr.results.values():
            if common.measured(result) and cr.products["ms"]:
                result["times_products"] = result["ms"] / cr.products["ms"]
        base = cr.results.get(TORCH)  # error ratios against torch materialized
        for result in cr.results.values() if base else ():
            result["ratios"] = {k: e / base["errors"][k] for k, e in result["errors"].items()
                                if base["errors"].get(k)}
        if cr.reference:
            cr.reference.grads = None
        del args
        common.release_memory(device)
    return case_results


# ----------------------------------------------------------------------------- reports
def _loss_text(cr: CaseResult) -> str:
    """The reference loss (CLIP: and its two directions) and its dtype, else why none."""
    ref = cr.reference
    if ref is None:
        return f"— (above {REFERENCE_LOSS_MAX_ROWS} rows: loss only checked finite)"
    text = f"{ref.loss:.4f}"
    if ref.directions:
        text += f" (i→t {ref.directions[0]:.4f}, t→i {ref.directions[1]:.4f})"
    return f"{text}, {ref.dtype}"


def _provider_columns(case_results: Sequence[CaseResult], cell: Callable) -> list[Column]:
    return [(label, lambda cr, k=key: cell(cr.results.get(k)))
            for key, label in common.provider_columns(case_results)]


def _fastest(cr: CaseResult) -> str:
    """The fastest measured result of a case, as ``ms (label)``."""
    measured = [r for r in cr.results.values() if common.measured(r)]
    best = min(measured, key=lambda r: r["ms"]) if measured else None
    return f"{common.format_ms(best['ms'])} ({best['label']})" if best else "—"


def result_tables(case_results: Sequence[CaseResult], text: bool = False) -> dict[str, str]:
    """The time-and-memory and the accuracy tables by title (markdown, or plain text)."""
    label: Column = ("case (loss b×c regime)", lambda cr: cr.case.label)
    ours = ("fusedloss × floor",
            lambda cr: common.format_ratio(cr.results.get(FUSEDLOSS, {}).get("times_floor")))
    products = [("products", lambda cr: common.format_ms(cr.products.get("ms"))),
                ("fusedloss × products", lambda cr: common.format_ratio(
                    cr.results.get(FUSEDLOSS, {}).get("times_products")))]
    time_columns = [
        label, *_provider_columns(case_results, lambda r: common.time_and_memory_cell(r, "—")),
        ("fastest", _fastest),
        ("floor 8r²c/R", lambda cr: common.format_ms(cr.floor_ms)),
        ("4r²c/R", lambda cr: common.format_ms(cr.floor_ms / 2)), ours, *products]
    accuracy_columns = [label, ("mean loss (reference)", _loss_text),
                        *_provider_columns(case_results, common.errors_text)]
    return {"Time and memory": common.table(time_columns, case_results, text),
            "Losses and gradient accuracy": common.table(accuracy_columns, case_results, text)}


def report_sections(info: dict[str, Any], case_results: Sequence[CaseResult]
                    ) -> tuple[list[tuple[str, str]], list[str]]:
    """The report's settings rows and body: time and memory, losses and gradient accuracy."""
    env, settings = info["environment"], info["settings"]
    timing = common.timing_text(env["device"], TimingSettings(settings["warmup_ms"],
                                                              settings["rep_ms"]))
    if common.uses_cuda(env["device"]):
        timing = (f"torch.autograd.grad(loss, leaves): {timing}; calls of ≥ {SLOW_MS:g} ms: "
                  f"median of clamp({SLOW_BUDGET_MS / 1e3:g} s / call, 2, {SLOW_MAX_REPS}) "
                  "calls timed by CUDA events (the JSON's 'timing' says which)")
    rows = [
        *common.environment_rows(env, info["peer_versions"], f", backend {settings['backend']}"),
        ("dtype, seed", f"{settings['dtype']}, seed {settings['seed']}"),
        common.matmul_row(info["matmul"]), ("timing", timing), ("memory", MEMORY_DEFINITION),
        ("time and memory", "median ms / peak MB, forward+backward (— = not run on this shape); "
                            "cost floors (docs/design.md) 8·r²·c/R, 4·r²·c/R with reuse (r = b, "
                            "or 2B for NT-Xent); products: the median ms of the cuBLAS products "
                            "of the same shapes timed together (the logits twice, SigLIP's once, "
                            "dA = G·B, dB = Gᵀ·A; in chunks of rows where large)"),
        ("gradient error", "relative L2 error ‖g − g_ref‖₂ / ‖g_ref‖₂ against a float64 "
                           "reference where rows²·c ≤ 2^40 (÷ torch materialized's error)"),
    ]
    body = [line for title, table in result_tables(case_results).items()
            for line in (f"## {title}", "", table, "")]
    return rows, body


# ----------------------------------------------------------------------------- --plot
PRODUCTS = "products (cuBLAS, same shapes)"


def plot_speed(files: list[dict[str, Any]], out: Path) -> Path | None:
    """``--plot``: ms against b (log-log) from results files, a panel per loss and width, a
    line per provider and the products dashed; later files replace earlier ones' points."""
    panels: dict[tuple[str, int], dict[str, dict[int, float]]] = {}  # lines: {key: {b: ms}}
    names: dict[str, str] = {}  # the measured providers' labels by key, then the products
    for cr in (cr for data in files for cr in data["cases"]):
        case = cr["case"]
        common.add_speed_points(panels.setdefault((case["loss"], case["width"]), {}), names,
                                cr["results"].values(), case["rows"],
                                (cr.get("products") or {}).get("ms"), PRODUCTS)
    names[PRODUCTS] = PRODUCTS
    plotted = [(f"{loss}, c = {width}", "rows b (2B for NT-Xent)", "median ms",
                common.speed_lines(lines, names, PRODUCTS))
               for (loss, width), lines in sorted(panels.items())]
    widths = len({width for _, width in panels}) or 1
    return common.save_plot(out, plotted, columns=widths, size=(4.5, 3.4), log="xy",
                            title="Contrastive losses, forward+backward, median ms against b\n"
                            + common.runs_text(files))


# ----------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    common.add_list(parser, "--shapes", SHAPES)
    common.add_list(parser, "--regimes", pairs.PAIR_REGIMES, note="(default: each shape's own)")
    common.add_list(parser, "--providers", PROVIDER_KEYS, DEFAULT_PROVIDERS, note=(
        f"(default: {','.join(DEFAULT_PROVIDERS)}); each shape runs those it supports"))
    common.add_list(parser, "--losses", GRID_LOSSES, GRID_LOSSES, note="(with --rows; default: "
                    "all)")
    add("--rows", type=common.int_list, help="a grid of cases instead of --shapes: rows b (2B "
        "for NT-Xent), e.g. 16384,65536,262144")
    add("--widths", type=common.int_list, default=[512],
        help="with --rows: the grid's widths c (default 512)")
    add("--plot", nargs="+", type=Path, metavar="RESULTS.json", help="draw ms against b from "
        "these results files into --out (.svg, .png, .pdf; default docs/contrastive_speed.svg) "
        "instead of running")
    common.add_common_arguments(
        parser, "rows/256, widths/8 and short timing: a smoke test that also runs on CPU")


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    if args.plot:
        return common.plot_results_files(args, "docs/contrastive_speed.svg", plot_speed, log)
    device = common.run_device(args, NAME, log)
    if device is None:
        return 2
    dtype = common.DTYPES[args.dtype]
    backend = "triton" if common.uses_cuda(device) else "torch"
    timing = common.timing_settings(args.warmup_ms, args.rep_ms, args.quick)
    table = prov.contrastive_providers(backend)
    providers = [table[key] for key in args.providers]
    grid = (args.losses, args.rows, args.widths) if args.rows else None
    cases = select_cases(args.shapes, args.regimes, args.quick, grid)
    environment = common.collect_environment(device)
    matmul = common.probe_matmul(device, args.quick, timing, dtype, log)
    try:
        case_results = run_cases(cases, providers, device=device, dtype=dtype, seed=args.seed,
                                 timing=timing, tflops=matmul["tflops"], log=log)
    finally:
        prov.destroy_benchmark_process_group()

    notes = [common.QUICK_NOTE] if args.quick else []
    notes += [f"{p.display_name()}: {note}" for p in providers
              if (note := getattr(p, "process_group_note", ""))]
    calls: dict[str, str] = {}
    for cr in case_results:
        for result in cr.results.values():
            if result["call"]:
                calls.setdefault(f"{result['label']}, {cr.case.loss}", result["call"])
            common.note_problem(notes, cr.case.label, result)
    settings = dict(dtype=common.dtype_name(dtype), seed=args.seed, quick=args.quick,
                    warmup_ms=timing.warmup_ms, rep_ms=timing.rep_ms, backend=backend,
                    providers=list(args.providers), grid=grid and list(map(list, grid)))
    info = dict(environment=environment, settings=settings, matmul=matmul,
                peer_versions={"inf-cl": common.package_version("inf-cl")},
                calls=calls, notes=notes)
    common.write_report(args.out, NAME, args.tag, environment, "Contrastive losses",
                        *report_sections(info, case_results),
                        dict(suite=NAME, **info, cases=list(map(asdict, case_results))),
                        "\n\n".join(result_tables(case_results, text=True).values()),
                        calls=calls, notes=notes, log=log)
    return 0


SUITE = Suite(NAME, "CLIP, InfoNCE, NT-Xent and SigLIP losses against materialized PyTorch, "
              "inf-cl and their cuBLAS products", add_arguments, run)
