"""Suite ``lm-head``: linear cross-entropy of an LM head, ours against torch and the peers, each
checked against float64, then its peak memory and median ms against the case's cuBLAS products."""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from benchmarks import common, inputs
from benchmarks.common import TimingSettings, column, format_error, format_ms
from benchmarks.providers import Provider, lm_head_providers, torch_eager_loss
from benchmarks.suites import Suite

NAME = "lm-head"
MODES = ("fwd+bwd", "fwd")
DEFAULT_N = 8192
DEFAULT_CASES = (("gemma2-2b", "peaked", "fwd+bwd"), ("gemma2-2b", "flat", "fwd+bwd"),
                 ("llama3-8b", "peaked", "fwd+bwd"), ("phi3.5", "peaked", "fwd+bwd"),
                 ("gemma2-2b", "peaked", "fwd"))
# Sanity bounds of the check: they catch a broken provider, not inaccuracy.
LOSS_TOLERANCE = 1e-2  # |loss − reference| ≤ LOSS_TOLERANCE · max(1, |reference|)
GRADIENT_ERROR_BOUND = 5e-2  # relative L2 error of dE and dC
NO_YARDSTICK = {"dE": None, "dC": None, "note": ""}  # torch eager's gradient errors
# A row's figures, in JSON order (benchmarks/README.md defines them).
FIGURES = ("peak_extra_mib", "loss", "loss_error", "err_hidden", "err_classifier", "ratio_hidden",
           "ratio_classifier", "times_floor", "times_products", "tiles_skipped")


@dataclass(frozen=True)
class Case:
    shape: inputs.LMHeadShape
    regime: str  # "peaked" | "flat" | "trained"
    mode: str  # "fwd+bwd" | "fwd"
    n: int

    @property
    def key(self) -> str:
        return f"{self.shape.name} {self.regime} N={self.n} {self.mode}"

    @property
    def with_backward(self) -> bool:
        return self.mode == "fwd+bwd"

    def floor_ms(self, tflops: float) -> float:
        """The cost floor of docs/design.md: 8NVD/R for fwd+bwd (nothing skipped), 2NVD/R fwd."""
        flops = (8 if self.with_backward else 2) * self.n * self.shape.vocab_size
        return flops * self.shape.hidden_size * 1e3 / (tflops * 1e12)


def select_cases(shapes: Sequence[str] | None, regimes: Sequence[str] | None,
                 modes: Sequence[str] | None, ns: Sequence[int], quick: bool,
                 trained_lm: str | None = None) -> list[Case]:
    """DEFAULT_CASES, or shapes × regimes × modes (unchosen: every shape, "peaked", "fwd+bwd"),
    each at every N, grouped by (shape, regime, N); "trained" at its own head, N ≤ its rows."""
    if shapes is None and regimes is None and modes is None:
        triples = list(DEFAULT_CASES)
    else:
        triples = [(s, r, m) for s in (shapes or list(inputs.LM_HEAD_SHAPES))
                   for r in (regimes or ["peaked"]) for m in (modes or ["fwd+bwd"])]
    cases: dict[tuple[str, str, int], list[Case]] = {}
    for shape_name, regime, mode in triples:
        if regime != inputs.TRAINED_REGIME:
            shape = inputs.LM_HEAD_SHAPES[shape_name]
            for n in ns:
                cases.setdefault((shape_name, regime, n), []).append(
                    Case(inputs.quick_shape(shape) if quick else shape, regime, mode, n))
    if inputs.TRAINED_REGIME in (regimes or ()):
        shape, rows = inputs.trained_size(trained_lm)
        for n in dict.fromkeys(min(n, rows) for n in ns):
            cases[shape.name, inputs.TRAINED_REGIME, n] = [
                Case(shape, inputs.TRAINED_REGIME, m, n) for m in (modes or ["fwd+bwd"])]
    return [case for group in cases.values() for case in group]


class Reference(NamedTuple):
    loss: float
    grad_hidden: Tensor | None  # dE, float64 (N, D)
    grad_classifier: Tensor | None  # dC, float64 (V, D)


def reference_float64(hidden: Tensor, classifier: Tensor, labels: Tensor, with_grads: bool,
                      rows_per_chunk: int = 0, softcap: float | None = None) -> Reference:
    """Mean cross-entropy of ``hidden @ classifier.T`` (soft-capped ``s·tanh(z/s)``) and its
    gradients in float64, a block of rows at a time (default ≤1024 rows, ≤2 GiB of logits)."""
    n, vocab = hidden.shape[0], classifier.shape[0]
    if rows_per_chunk <= 0:
        rows_per_chunk = max(1, min(1024, (2 << 30) // (8 * vocab)))
    classifier64 = classifier.detach().to(torch.float64)
    grad_hidden = torch.empty_like(hidden, dtype=torch.float64) if with_grads else None
    grad_classifier = torch.zeros_like(classifier64) if with_grads else None
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for start in range(0, n, rows_per_chunk):
        stop = min(n, start + rows_per_chunk)
        block, block_labels = hidden[start:stop].detach().to(torch.float64), labels[start:stop]
        logits = block @ classifier64.T
        slope = None
        if softcap is not None:
            slope = torch.tanh(logits.div_(softcap))
            torch.mul(slope, softcap, out=logits)
            slope.square_().neg_().add_(1.0)  # d cap(z) / dz = 1 − tanh²(z/s)
        lse = torch.logsumexp(logits, dim=1)
        total += (lse - logits.gather(1, block_labels[:, None]).squeeze(1)).sum()
        if with_grads:
            probabilities = logits.sub_(lse[:, None]).exp_()  # reuses the logits' memory
            probabilities[torch.arange(stop - start, device=hidden.device), block_labels] -= 1.0
            probabilities /= n
            if slope is not None:
                probabilities *= slope
            grad_hidden[start:stop] = probabilities @ classifier64
            grad_classifier.addmm_(probabilities.T, block)
        del logits, lse, block, slope
    return Reference(float(total) / n, grad_hidden, grad_classifier)


def measure_yardstick(tensors: tuple[Tensor, Tensor, Tensor], reference: Reference,
                      softcap: float | None) -> dict:
    """torch eager's gradient errors in the input dtype (the accuracy bar): {dE, dC, note}."""
    try:
        grads = torch.autograd.grad(torch_eager_loss(*tensors, softcap), tensors[:2])
        return {"dE": common.relative_l2_error(grads[0], reference.grad_hidden),
                "dC": common.relative_l2_error(grads[1], reference.grad_classifier), "note": ""}
    except Exception as error:  # an OOM here must not end the run
        note = f"torch eager yardstick unavailable: {common.describe_error(error)}"
        return {**NO_YARDSTICK, "note": note}


@dataclass
class CaseResult:
    case: Case
    floor_ms: float
    reference_loss: float
    yardstick: dict  # torch eager's errors: {dE, dC, note}
    products: dict  # common.time_products()
    results: dict[str, common.Row] = field(default_factory=dict)


def run_provider(provider: Provider, cr: CaseResult, tensors: tuple[Tensor, Tensor, Tensor],
                 reference: Reference, timing: TimingSettings) -> common.Row:
    """Check (the untimed first call: loss, gradients, tiles skipped), measure memory, time."""
    from fusedloss.core import engine

    case, device, leaves = cr.case, tensors[0].device, tensors[:2]
    row = common.new_row(provider.key, provider.display_name(), **dict.fromkeys(FIGURES))
    ok, loss_fn = common.stage(row, lambda: provider.build(device, case.shape.softcap), device)
    if not ok:
        return row
    row["call"] = provider.describe()

    def timed() -> Any:  # fwd+bwd: autograd.grad; fwd: no graph (no gradient formed inside)
        if case.with_backward:
            return torch.autograd.grad(loss_fn(*tensors), leaves)
        with torch.no_grad():
            return loss_fn(*tensors)

    def check() -> list[str]:
        with engine.recording_backward_tiles() as tiles:
            loss = loss_fn(*tensors)
            grads = torch.autograd.grad(loss, leaves) if case.with_backward else None
        if tiles:  # fusedloss's Triton backward ran: what its filter skipped
            computed, total = (int(x) for x in torch.stack(tiles).sum(0).tolist())
            row["tiles_skipped"] = 1.0 - computed / total
        row["loss"] = float(loss.detach().float())
        row["loss_error"], problems = common.check_loss(row["loss"], reference.loss,
                                                        LOSS_TOLERANCE)
        if grads is not None:
            row["err_hidden"], row["err_classifier"] = (
                common.relative_l2_error(grad, exact)
                for grad, exact in zip(grads, reference[1:], strict=True))
            if cr.yardstick["dE"]:
                row["ratio_hidden"] = row["err_hidden"] / cr.yardstick["dE"]
                row["ratio_classifier"] = row["err_classifier"] / cr.yardstick["dC"]
            errors = {"dE": row["err_hidden"], "dC": row["err_classifier"]}
            problems += common.bound_problems(errors, lambda _: GRADIENT_ERROR_BOUND)
        return problems

    gradient_bytes = common.tensor_bytes(leaves) if case.with_backward else 0
    if common.check_and_time(row, device, check, timed, gradient_bytes, lambda step, _: {
            "ms": common.median_ms(step, device, timing)}):
        row["times_floor"] = row["ms"] / cr.floor_ms
        if cr.products["ms"]:
            row["times_products"] = row["ms"] / cr.products["ms"]
    return row


def run_cases(cases: Sequence[Case], providers: Sequence[Provider], *, device: torch.device,
              dtype: torch.dtype, seed: int, timing: TimingSettings, tflops: float,
              log: Callable[[str], None] = print,
              trained_lm: str | None = None) -> list[CaseResult]:
    """Every provider on every case; cases sharing inputs (adjacent) share one reference."""
    case_results: list[CaseResult] = []
    for (_, regime, n), same_inputs in itertools.groupby(cases, lambda c: (c.shape, c.regime, c.n)):
        group = list(same_inputs)
        shape = group[0].shape
        if regime == inputs.TRAINED_REGIME:
            hidden, classifier, labels, _ = inputs.load_trained_regime(
                trained_lm, device=device, dtype=dtype, n=n)
        else:
            hidden, classifier, labels = inputs.make_lm_head_inputs(
                n, shape.vocab_size, shape.hidden_size, regime, dtype=dtype, device=device,
                seed=seed)
        tensors = (hidden.requires_grad_(True), classifier.requires_grad_(True), labels)
        with_grads = any(case.with_backward for case in group)
        reference = reference_float64(*tensors, with_grads, softcap=shape.softcap)
        bar = measure_yardstick(tensors, reference, shape.softcap) if with_grads else NO_YARDSTICK
        common.release_memory(device)
        log(f"[{shape.label} {regime}, N {n}]: reference loss {reference.loss:.4f} (log V = "
            f"{math.log(shape.vocab_size):.2f}); torch bf16 error dE "
            f"{format_error(bar['dE'])}, dC {format_error(bar['dC'])} {bar['note']}".rstrip())
        for case in group:
            products = common.time_products(hidden, classifier, timing,
                                            backward=case.with_backward)
            cr = CaseResult(case, case.floor_ms(tflops), reference.loss,
                            dict(bar if case.with_backward else NO_YARDSTICK), products)
            for provider in providers:
                r = cr.results[provider.key] = run_provider(provider, cr, tensors, reference,
                                                            timing)
                cells = {head: cell(_item(cr, r)) for head, cell in FIGURE_COLUMNS[2:]}
                figures = ", ".join(f"{head} {text}" for head, text in cells.items() if text)
                log(f"  {case.key}, {r['label']}: {figures}")
            case_results.append(cr)
        del hidden, classifier, labels, tensors, reference
        common.release_memory(device)
    return case_results


def _pair(a: float | None, b: float | None, fmt: str = ".2f") -> str:
    return "—" if a is None or b is None else f"{a:{fmt}} / {b:{fmt}}"


# "All figures" of the report (items: _item()); the summary printed last leaves some out.
FIGURE_COLUMNS: list[common.Column] = [
    column("case", "case"), column("provider", "label"), column("status", "status"),
    column("ms", "ms", format_ms), column("products ms", "products_ms", format_ms),
    column("× products", "times_products", common.format_ratio),
    column("× floor", "times_floor", common.format_ratio),
    column("MiB", "peak_extra_mib", common.format_mib), column("loss", "loss", "{:.5f}".format),
    column("|loss − ref|", "loss_error", format_error),
    column("dE err", "err_hidden", format_error), column("dC err", "err_classifier", format_error),
    ("err ratio dE / dC", lambda r: _pair(r.get("ratio_hidden"), r.get("ratio_classifier"))),
    column("tiles skipped", "tiles_skipped", lambda share: f"{100 * share:.2f}%"),
    column("note", "note"),
]
SUMMARY_COLUMNS = [c for c in FIGURE_COLUMNS
                   if c[0] not in ("loss", "|loss − ref|", "dE err", "dC err", "note")]


def _item(cr: CaseResult, row: common.Row) -> common.Row:
    """A row of the figure tables: the provider's row with its case's key and products' ms."""
    return {**row, "case": cr.case.key, "products_ms": cr.products["ms"]}


def _items(case_results: Sequence[CaseResult]) -> list[common.Row]:
    return [_item(cr, r) for cr in case_results for r in cr.results.values()]


def _time_table(case_results: Sequence[CaseResult]) -> str:
    """A row per head, regime and N: the float64 loss, torch eager's errors, then per mode the
    products' ms (and how they ran, if in chunks) and each provider's ``ms / MiB (× products)``."""
    columns = common.provider_columns(case_results)
    modes = [mode for mode in MODES if any(cr.case.mode == mode for cr in case_results)]
    groups: dict[tuple[str, str, int], dict[str, CaseResult]] = {}
    for cr in case_results:
        groups.setdefault((cr.case.shape.label, cr.case.regime, cr.case.n), {})[cr.case.mode] = cr

    def cells(cr: CaseResult | None) -> list[str]:
        if cr is None:
            return [""] * (1 + len(columns))
        method = "" if cr.products["method"] == "whole" else f" ({cr.products['method']})"
        row = [format_ms(cr.products["ms"]) + method]
        for key, _ in columns:
            r = cr.results.get(key) or {}
            ratio = f" ({r['times_products']:.2f}×)" if r.get("times_products") else ""
            row.append(common.time_and_memory_cell(r or None, "") + ratio)
        return row

    body = []
    for (head, regime, n), by_mode in groups.items():
        first = next(iter(by_mode.values()))
        bar = by_mode.get("fwd+bwd", first).yardstick
        row = [head, regime, str(n), f"{first.reference_loss:.5f}",
               _pair(bar["dE"], bar["dC"], ".1e")]
        body.append(row + [cell for mode in modes for cell in cells(by_mode.get(mode))])
    labels = ["products", *(label for _, label in columns)]
    headers = ["head (V, D)", "regime", "N", "float64 loss", "torch bf16 dE / dC",
               *(f"{mode}: {label}" for mode in modes for label in labels)]
    return common.markdown_table(headers, body)


def report_sections(run: dict[str, Any], case_results: Sequence[CaseResult]
                    ) -> tuple[list[tuple[str, str]], list[str]]:
    """The report's settings rows and body: the time table and every figure."""
    env, settings = run["environment"], run["settings"]
    timing = TimingSettings(settings["warmup_ms"], settings["rep_ms"])
    rows = [*common.environment_rows(env, run["peer_versions"]),
            ("N, dtype, seed", f"{', '.join(map(str, settings['n']))} tokens, "
             f"{settings['dtype']}, seed {settings['seed']}"),
            common.matmul_row(run["matmul"]), ("timing", common.timing_text(env["device"], timing)),
            ("definitions", "benchmarks/README.md, 'The lm-head suite'")]
    intro = ("Median ms / peak MiB above inputs and gradient buffers (× the cuBLAS products "
             "alone, 'products'), per mode. torch bf16: torch eager's relative L2 error against "
             "float64, the bar of 'err ratio'. × floor: ms ÷ 8NVD/R (fwd+bwd) or 2NVD/R (fwd), "
             "R the matmul rate above (docs/design.md).")
    return rows, ["## Time and memory", "", intro, "", _time_table(case_results), "",
                  *common.section("All figures", "", FIGURE_COLUMNS, _items(case_results))]


def results_json(run: dict[str, Any], case_results: Sequence[CaseResult]) -> dict[str, Any]:
    """The run's settings and every case's raw figures."""
    cases = [{"case": cr.case.key, "shape": cr.case.shape.name,
              "vocab_size": cr.case.shape.vocab_size, "hidden_size": cr.case.shape.hidden_size,
              "softcap": cr.case.shape.softcap, "n": cr.case.n, "regime": cr.case.regime,
              "mode": cr.case.mode, "floor_ms": cr.floor_ms, "products": cr.products,
              "reference_loss": cr.reference_loss, "torch_bf16_error": cr.yardstick,
              "results": list(cr.results.values())}
             for cr in case_results]
    return {**run, "cases": cases}


MODE_TITLES = {"fwd+bwd": "forward+backward", "fwd": "forward only"}
PRODUCTS = "products (cuBLAS: Z = E·Cᵀ, dE, dC)"


def plot_speed(files: list[dict[str, Any]], out: Path) -> Path | None:
    """``--plot``: ms against N (log-log) from results files, a panel per head, regime and mode,
    a line per provider and the products dashed; later files replace earlier ones' points."""
    panels: dict[tuple[str, str, str], dict[str, Any]] = {}  # title, lines: {key: {N: ms}}
    names: dict[str, str] = {}  # the measured providers' labels by key, then the products
    for case in (case for data in files for case in data["cases"]):
        softcap = f", softcap {case['softcap']:g}" if case.get("softcap") else ""
        title = (f"{case['shape']} (V {case['vocab_size']}, D {case['hidden_size']}{softcap})\n"
                 f"{case['regime']}, {MODE_TITLES[case['mode']]}")
        panel = panels.setdefault((case["shape"], case["regime"], case["mode"]),
                                  {"title": title, "lines": {}})
        common.add_speed_points(panel["lines"], names, case["results"], case["n"],
                                (case.get("products") or {}).get("ms"), PRODUCTS)
    names[PRODUCTS] = PRODUCTS
    heads = list(dict.fromkeys(key[:2] for key in panels))
    modes = list(dict.fromkeys(key[2] for key in panels))
    plotted = [panel and (panel["title"], "tokens N", "median ms",
                          common.speed_lines(panel["lines"], names, PRODUCTS))
               for panel in (panels.get((*head, mode)) for head in heads for mode in modes)]
    return common.save_plot(
        out, plotted, columns=len(modes), size=(5.0, 3.6), log="xy",
        title="LM-head linear cross-entropy, median ms against N\n" + common.runs_text(files))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    common.add_list(parser, "--shapes", inputs.LM_HEAD_SHAPES, note="")
    common.add_list(parser, "--regimes", [*inputs.REGIMES, inputs.TRAINED_REGIME],
                    note="(default with --shapes/--modes: peaked)")
    add("--trained-lm", help="the trained regime's directory or file, from `python -m "
        f"benchmarks.trained_lm --out DIR` (default ${inputs.TRAINED_LM_ENV})")
    common.add_list(parser, "--modes", MODES, note="(default with --shapes/--regimes: fwd+bwd)")
    common.add_list(parser, "--providers", lm_head_providers(), lm_head_providers())
    add("--n", type=common.int_list, help="comma list of token counts N, e.g. 4096,16384 "
        f"(default {DEFAULT_N}; {inputs.QUICK_N} with --quick)")
    common.add_common_arguments(parser, "tiny shapes and short timing: a smoke test that also "
                                "runs on CPU")
    add("--plot", nargs="+", type=Path, metavar="RESULTS.json", help="draw ms against N from "
        "these results files into --out (.svg, .png, .pdf; default docs/lm_head_speed.svg) "
        "instead of running")


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    if args.plot:
        return common.plot_results_files(args, "docs/lm_head_speed.svg", plot_speed, log)
    device = common.run_device(args, NAME, log)
    if device is None:
        return 2
    quick, dtype = bool(args.quick), common.DTYPES[args.dtype]
    ns = args.n or [inputs.QUICK_N if quick else DEFAULT_N]
    timing = common.timing_settings(args.warmup_ms, args.rep_ms, quick)
    notes: list[str] = [common.QUICK_NOTE] if quick else []
    if not common.uses_cuda(device) and any(p.startswith("fusedloss") for p in args.providers):
        notes.append(common.use_triton_interpreter())
    try:
        cases = select_cases(args.shapes, args.regimes, args.modes, ns, quick, args.trained_lm)
    except FileNotFoundError as error:
        log(str(error))
        return 2
    environment = common.collect_environment(device)
    log(f"lm-head on {environment['device_name']}: torch {environment['torch']}, triton "
        f"{environment['triton']}, N={','.join(map(str, ns))}, {args.dtype}, {len(cases)} cases")
    matmul = common.probe_matmul(device, quick, timing, dtype, log)
    providers = [lm_head_providers()[key] for key in args.providers]
    case_results = run_cases(cases, providers, device=device, dtype=dtype, seed=args.seed,
                             timing=timing, tflops=matmul["tflops"], log=log,
                             trained_lm=args.trained_lm)
    for cr in case_results:
        for r in cr.results.values():
            common.note_problem(notes, cr.case.key, r)
    notes += [f"{cr.case.key}: {note}" for cr in case_results
              for note in (cr.yardstick["note"], cr.products["note"]) if note]
    settings = {"n": ns, "dtype": args.dtype, "seed": args.seed, "quick": quick,
                "warmup_ms": timing.warmup_ms, "rep_ms": timing.rep_ms, "providers": args.providers}
    peers = {name: common.package_version(name) for name in ("cut-cross-entropy", "liger-kernel")}
    calls = {r["label"]: r["call"] for r in _items(case_results) if r["call"]}
    run_info = {"suite": NAME, "environment": environment, "settings": settings, "matmul": matmul,
                "peer_versions": peers, "calls": calls, "notes": notes}
    summary = common.table(SUMMARY_COLUMNS, _items(case_results), text=True)
    common.write_report(args.out, "lm_head", args.tag, environment,
                        "LM-head linear cross-entropy", *report_sections(run_info, case_results),
                        results_json(run_info, case_results), summary, calls=calls, notes=notes,
                        log=log)
    return 0


SUITE = Suite(name=NAME, run=run, add_arguments=add_arguments,
              help="linear cross-entropy of an LM head (llama3, qwen2.5, gemma2, phi3.5, gpt2, "
                   "smollm2 shapes)")
