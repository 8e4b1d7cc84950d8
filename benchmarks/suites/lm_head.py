"""Suite ``lm-head``: linear cross-entropy of an LM head, ours against torch and the peers.

Per case (shape × regime × N × mode) and provider: an untimed check against a float64
reference (also compiles; records tiles skipped), peak memory, and the ``do_bench`` median
with its ratio to the case's cuBLAS products. Column definitions: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from benchmarks import common
from benchmarks.common import FAIL, NOT_INSTALLED, OK, PASS, UNAVAILABLE, TimingSettings
from benchmarks.inputs import (
    LM_HEAD_SHAPES,
    QUICK_N,
    REGIMES,
    TRAINED_LM_ENV,
    TRAINED_REGIME,
    LMHeadShape,
    load_trained_regime,
    make_lm_head_inputs,
    quick_shape,
    trained_rows,
    trained_shape,
)
from benchmarks.providers import LMHeadProvider, Unavailable, lm_head_providers, torch_eager_loss
from benchmarks.suites import Suite

NAME = "lm-head"
RESULTS_PREFIX = "lm_head"
MODES = ("fwd+bwd", "fwd")
DEFAULT_N = 8192
DEFAULT_CASES: tuple[tuple[str, str, str], ...] = (
    ("gemma2-2b", "peaked", "fwd+bwd"), ("gemma2-2b", "flat", "fwd+bwd"),
    ("llama3-8b", "peaked", "fwd+bwd"), ("phi3.5", "peaked", "fwd+bwd"),
    ("gemma2-2b", "peaked", "fwd"))

# Sanity bounds of the check: they catch a broken provider, not inaccuracy.
LOSS_TOLERANCE = 1e-2  # |loss − reference| ≤ LOSS_TOLERANCE · max(1, |reference|)
GRADIENT_ERROR_BOUND = 5e-2  # relative L2 error of dE and dC

MEMORY_DEFINITION = (
    "peak MiB above inputs and gradient buffers = torch.cuda.max_memory_allocated() during one "
    "call (autograd.grad of the loss w.r.t. (E, C), or the forward alone with E, C requiring "
    "grad) − memory_allocated() before it − the bytes of dE and dC (fwd+bwd only); the cache "
    "emptied and the peak reset right before the call"
)
PRODUCTS_CHUNK_ROWS = 16384
PRODUCTS_MEMORY_SHARE = 0.5  # Z and G whole while they take at most this share of free memory
PRODUCTS_DEFINITION = (
    "the cuBLAS products an exact method cannot avoid, timed as the providers are: Z = E @ C.T, "
    "and for fwd+bwd dE = G @ C, dC = G.T @ E with a random (N, V) G; in chunks of "
    f"{PRODUCTS_CHUNK_ROWS} rows when Z and G would take over {PRODUCTS_MEMORY_SHARE:.0%} of "
    "the free memory. '× products' = a provider's ms ÷ the products' ms"
)
ERROR_DEFINITION = (
    "relative L2 error ‖g − g_ref‖₂ / ‖g_ref‖₂ of dE and dC (mean loss) against a float64 "
    "reference of the same inputs, computed ≤1024 rows at a time; 'err ratio' = a method's "
    "error ÷ torch eager's in the input dtype, dE / dC"
)
INPUTS_DEFINITION = (
    "C = randn(V, D)/√D; y = randint(0, V, (N,)); flat: E = randn(N, D); peaked: "
    "E = 13·C[y] + 2·randn(N, D), then C[:, 0] = −log(rank)/4 (rank a random "
    "permutation of 1..V), E[:, 0] = 4; both cast to the dtype afterwards"
)
# The cost floors of docs/design.md: FLOPs per N·V·D, divided by the matmul rate R.
FLOORS = {"forward": 2, "backward_unskipped": 6, "forward_backward_unskipped": 8}


@dataclass(frozen=True)
class Case:
    shape: LMHeadShape
    regime: str  # "peaked" | "flat" | "trained"
    mode: str  # "fwd+bwd" | "fwd"
    n: int

    @property
    def key(self) -> str:
        return f"{self.shape.name} {self.regime} N={self.n} {self.mode}"

    @property
    def label(self) -> str:
        return f"{self.shape.label} {self.regime}, N {self.n}" + (
            ", forward only" if self.mode == "fwd" else "")

    @property
    def with_backward(self) -> bool:
        return self.mode == "fwd+bwd"

    def floors_ms(self, tflops: float) -> dict[str, float]:
        nvd = self.n * self.shape.vocab_size * self.shape.hidden_size
        return {floor: flops * nvd * 1e3 / (tflops * 1e12) for floor, flops in FLOORS.items()}

    def floor_ms(self, tflops: float) -> float:
        """8NVD/R for fwd+bwd (nothing skipped), 2NVD/R forward only."""
        return self.floors_ms(tflops)[
            "forward_backward_unskipped" if self.with_backward else "forward"]


def select_cases(shapes: Sequence[str] | None, regimes: Sequence[str] | None,
                 modes: Sequence[str] | None, ns: Sequence[int], quick: bool,
                 trained_lm: str | None = None) -> list[Case]:
    """DEFAULT_CASES, or shapes × regimes × modes (unchosen axes: every shape, "peaked",
    "fwd+bwd"), each at every N, grouped by (shape, regime, N). "trained" runs at the trained
    model's own head (``trained_lm`` or $FUSEDLOSS_TRAINED_LM), N capped at its rows."""
    if shapes is None and regimes is None and modes is None:
        triples = list(DEFAULT_CASES)
    else:
        triples = [(s, r, m) for s in (shapes or list(LM_HEAD_SHAPES))
                   for r in (regimes or ["peaked"]) for m in (modes or ["fwd+bwd"])]
    cases: dict[tuple[str, str, int], list[Case]] = {}
    for shape_name, regime, mode in triples:
        if regime != TRAINED_REGIME:
            shape = LM_HEAD_SHAPES[shape_name]
            for n in ns:
                cases.setdefault((shape_name, regime, n), []).append(
                    Case(quick_shape(shape) if quick else shape, regime, mode, n))
    if TRAINED_REGIME in (regimes or ()):
        shape, rows = trained_shape(trained_lm), trained_rows(trained_lm)
        for n in dict.fromkeys(min(n, rows) for n in ns):
            cases[shape.name, TRAINED_REGIME, n] = [
                Case(shape, TRAINED_REGIME, m, n) for m in (modes or ["fwd+bwd"])]
    return [case for group in cases.values() for case in group]


@dataclass
class Reference:
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
        block = hidden[start:stop].detach().to(torch.float64)
        block_labels = labels[start:stop]
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


def yardstick(dE: float | None = None, dC: float | None = None, note: str = "") -> dict:  # noqa: N803
    """torch eager's gradient errors in the input dtype (the accuracy bar), as in the JSON."""
    return {"dE": dE, "dC": dC, "note": note}


def measure_yardstick(hidden: Tensor, classifier: Tensor, labels: Tensor, reference: Reference,
                      softcap: float | None = None) -> dict:
    try:
        loss = torch_eager_loss(hidden, classifier, labels, softcap)
        grads = torch.autograd.grad(loss, (hidden, classifier))
        del loss
        return yardstick(common.relative_l2_error(grads[0], reference.grad_hidden),
                         common.relative_l2_error(grads[1], reference.grad_classifier))
    except Exception as error:  # an OOM here must not end the run
        return yardstick(note=f"torch eager yardstick unavailable: {common.describe_error(error)}")


def products_chunk_rows(n: int, vocab: int, with_backward: bool, element_size: int,
                        device: torch.device) -> int:
    """N while Z (and G) take at most PRODUCTS_MEMORY_SHARE of free memory, else
    PRODUCTS_CHUNK_ROWS."""
    if n <= PRODUCTS_CHUNK_ROWS or not common.uses_cuda(device):
        return n
    needed = (2 if with_backward else 1) * n * vocab * element_size
    free, _ = torch.cuda.mem_get_info(device)
    return n if needed <= PRODUCTS_MEMORY_SHARE * free else PRODUCTS_CHUNK_ROWS


def time_products(hidden: Tensor, classifier: Tensor, with_backward: bool, timing: TimingSettings,
                  rows_per_chunk: int | None = None) -> dict[str, Any]:
    """Median ms of the products (PRODUCTS_DEFINITION): {ms, rows_per_chunk, method, note};
    buffers and G allocated once; an error (OOM) leaves ms None with a note."""
    e, c = hidden.detach(), classifier.detach()
    n, vocab, device = e.shape[0], c.shape[0], e.device
    rows = min(n, rows_per_chunk or products_chunk_rows(
        n, vocab, with_backward, e.element_size(), device))
    chunks = -(-n // rows)
    result = {"ms": None, "rows_per_chunk": rows,
              "method": "whole" if chunks == 1 else f"{chunks} chunks of {rows} rows", "note": ""}

    def products() -> None:
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            e_chunk = e[start:stop]
            torch.mm(e_chunk, c.T, out=z[: stop - start])
            if with_backward:
                g_chunk = g[: stop - start]
                torch.mm(g_chunk, c, out=grad_hidden[start:stop])
                if start == 0:
                    torch.mm(g_chunk.T, e_chunk, out=grad_classifier)
                else:
                    grad_classifier.addmm_(g_chunk.T, e_chunk)

    try:
        z = e.new_empty(rows, vocab)
        if with_backward:
            generator = torch.Generator(device=device).manual_seed(0)
            g = e.new_empty(rows, vocab).normal_(generator=generator)  # dense: no zeros
            grad_hidden, grad_classifier = torch.empty_like(e), torch.empty_like(c)
        result["ms"] = common.median_ms(products, device, timing)
    except Exception as error:  # an OOM here must not end the run
        result["note"] = f"products not timed: {common.describe_error(error)}"
    finally:
        z = g = grad_hidden = grad_classifier = None
    if common.uses_cuda(device):
        torch.cuda.empty_cache()
    return result


@dataclass
class ProviderResult(common.ProviderResultBase):
    """One provider on one case; the JSON's result fields, in this order."""

    peak_extra_mib: float | None = None
    loss: float | None = None
    loss_error: float | None = None  # |loss − float64 reference|
    err_hidden: float | None = None  # relative L2 error of dE
    err_classifier: float | None = None  # relative L2 error of dC
    ratio_hidden: float | None = None  # err_hidden ÷ torch eager's (the yardstick)
    ratio_classifier: float | None = None
    times_floor: float | None = None  # ms ÷ the case's floor
    times_products: float | None = None  # ms ÷ the case's products
    tiles_skipped: float | None = None  # fusedloss's Triton backward: share of tiles skipped


@dataclass
class CaseResult:
    case: Case
    floors_ms: dict[str, float]
    reference_loss: float | None
    yardstick: dict = field(default_factory=yardstick)  # torch eager's errors: yardstick()
    results: dict[str, ProviderResult] = field(default_factory=dict)
    products: dict = field(default_factory=lambda: {
        "ms": None, "rows_per_chunk": None, "method": "", "note": ""})  # time_products()


def run_provider(provider: LMHeadProvider, case: Case, inputs: tuple[Tensor, Tensor, Tensor],
                 reference: Reference, bar: dict, timing: TimingSettings,
                 floor_ms: float | None, products_ms: float | None = None) -> ProviderResult:
    """Check, measure memory, and time one provider on one case."""
    hidden, classifier, labels = inputs
    device = hidden.device
    result = ProviderResult(provider.key, provider.display_name())
    try:
        loss_fn = provider.build(device, case.shape.softcap)
    except Unavailable as error:
        result.status = NOT_INSTALLED if provider.is_peer else UNAVAILABLE
        result.note = str(error)
        return result
    result.call = provider.describe()

    def forward() -> Tensor:
        return loss_fn(hidden, classifier, labels)

    def timed() -> Any:  # fwd+bwd: autograd.grad; fwd: no graph (no gradient formed inside)
        if case.with_backward:
            return torch.autograd.grad(forward(), (hidden, classifier))
        with torch.no_grad():
            return forward()

    with common.failures_recorded(result, device):
        _check(result, forward, (hidden, classifier), case, reference, bar)
        common.release_memory(device)
        gradient_bytes = (hidden.numel() + classifier.numel()) * hidden.element_size()
        result.peak_extra_mib = common.peak_extra_mib(
            timed, device, gradient_bytes if case.with_backward else 0)
        result.ms = common.median_ms(timed, device, timing)
        if floor_ms:
            result.times_floor = result.ms / floor_ms
        if products_ms:
            result.times_products = result.ms / products_ms
    return result


def _check(result: ProviderResult, forward: Callable[[], Tensor], leaves: tuple[Tensor, Tensor],
           case: Case, reference: Reference, bar: dict) -> None:
    """The untimed first call: loss and gradients against the reference, tiles skipped."""
    from fusedloss.core import engine

    problems = []
    with engine.recording_backward_tiles() as tiles:
        loss = forward()
        if case.with_backward:
            grad_hidden, grad_classifier = torch.autograd.grad(loss, leaves)
    if tiles:  # fusedloss's Triton backward ran: what its filter skipped
        computed, total = (int(x) for x in torch.stack(tiles).sum(0).tolist())
        result.tiles_skipped = 1.0 - computed / total if total else 0.0
    if case.with_backward:
        result.err_hidden = common.relative_l2_error(grad_hidden, reference.grad_hidden)
        result.err_classifier = common.relative_l2_error(grad_classifier, reference.grad_classifier)
        del grad_hidden, grad_classifier
        if bar["dE"]:
            result.ratio_hidden = result.err_hidden / bar["dE"]
        if bar["dC"]:
            result.ratio_classifier = result.err_classifier / bar["dC"]
        for name, error in (("dE", result.err_hidden), ("dC", result.err_classifier)):
            if not error <= GRADIENT_ERROR_BOUND:  # also catches NaN
                problems.append(f"{name} relative error {error:.2e} > {GRADIENT_ERROR_BOUND}")
    result.loss = float(loss.detach().float())
    del loss
    result.loss_error, loss_problems = common.check_loss(result.loss, reference.loss,
                                                         LOSS_TOLERANCE)
    common.mark_wrong(result, problems + loss_problems)


def run_cases(cases: Sequence[Case], providers: Sequence[LMHeadProvider], *,
              device: torch.device, dtype: torch.dtype, seed: int, timing: TimingSettings,
              tflops: float, log: Callable[[str], None] = print,
              trained_lm: str | None = None) -> list[CaseResult]:
    """Every provider on every case; cases sharing inputs share one reference."""
    case_results: list[CaseResult] = []
    groups: dict[tuple[str, str, int], list[Case]] = {}
    for case in cases:
        groups.setdefault((case.shape.name, case.regime, case.n), []).append(case)
    for group in groups.values():
        first = group[0]
        shape = first.shape
        if first.regime == TRAINED_REGIME:
            hidden, classifier, labels, _ = load_trained_regime(
                trained_lm, device=device, dtype=dtype, n=first.n)
        else:
            hidden, classifier, labels = make_lm_head_inputs(
                first.n, shape.vocab_size, shape.hidden_size, first.regime,
                dtype=dtype, device=device, seed=seed)
        hidden.requires_grad_(True)
        classifier.requires_grad_(True)
        with_grads = any(case.with_backward for case in group)
        reference = reference_float64(hidden, classifier, labels, with_grads,
                                      softcap=shape.softcap)
        bar = (measure_yardstick(hidden, classifier, labels, reference, shape.softcap)
               if with_grads else yardstick())
        common.release_memory(device)
        log(f"[{shape.label} {first.regime}, N {first.n}]: reference loss {reference.loss:.4f} "
            f"(log V = {math.log(shape.vocab_size):.2f}); torch bf16 error dE "
            f"{common.format_error(bar['dE'])}, dC {common.format_error(bar['dC'])} "
            f"{bar['note']}".rstrip())
        for case in group:
            products = time_products(hidden, classifier, case.with_backward, timing)
            cr = CaseResult(case, case.floors_ms(tflops), reference.loss,
                            bar if case.with_backward else yardstick(), products=products)
            log(f"  {case.key:<34} {'products (' + products['method'] + ')':<34} "
                f"{common.format_ms(products['ms'])} ms {products['note']}".rstrip())
            for provider in providers:
                outcome = run_provider(provider, case, (hidden, classifier, labels), reference,
                                       cr.yardstick, timing, case.floor_ms(tflops),
                                       products["ms"])
                cr.results[provider.key] = outcome
                log(f"  {case.key:<34} {outcome.label:<34} "
                    f"{common.progress_line(outcome, _figures_text)}")
            case_results.append(cr)
        del hidden, classifier, labels, reference
        common.release_memory(device)
    return case_results


def _figures_text(result: ProviderResult) -> str:
    text = (f"{common.format_ms(result.ms)} ms ({common.format_ratio(result.times_products)}× "
            f"products), {common.format_mib(result.peak_extra_mib)} MiB, "
            f"loss err {result.loss_error:.1e}")
    if result.err_hidden is not None:
        text += f", dE {result.err_hidden:.1e}, dC {result.err_classifier:.1e}"
    return text


@dataclass(kw_only=True)
class RunInfo(common.RunInfoBase):
    n: list[int]  # the token counts N


def _pair(a: float | None, b: float | None, fmt: str = ".2f") -> str:
    return "—" if a is None or b is None else f"{a:{fmt}} / {b:{fmt}}"


def _skipped(result: ProviderResult) -> str:
    return "—" if result.tiles_skipped is None else f"{100 * result.tiles_skipped:.2f}%"


# The per-provider columns of "All figures": (header, cell).
FIGURE_COLUMNS: list[tuple[str, Callable[[ProviderResult], str]]] = [
    ("ms", lambda r: common.format_ms(r.ms)),
    ("× products", lambda r: common.format_ratio(r.times_products)),
    ("× floor", lambda r: common.format_ratio(r.times_floor)),
    ("MiB", lambda r: common.format_mib(r.peak_extra_mib)),
    ("loss", lambda r: common.loss_cells(r)[0]),
    ("|loss − ref|", lambda r: common.loss_cells(r)[1]),
    ("dE err", lambda r: common.format_error(r.err_hidden)),
    ("dC err", lambda r: common.format_error(r.err_classifier)),
    ("err ratio dE / dC", lambda r: _pair(r.ratio_hidden, r.ratio_classifier)),
    ("tiles skipped", _skipped),
]


def render_markdown(info: RunInfo, case_results: Sequence[CaseResult]) -> str:
    env, tflops = info.environment, info.matmul["tflops"]
    lines = [f"# LM-head linear cross-entropy: {env['device_name']}, {env['date']}", ""]
    if info.quick:
        lines += ["> **--quick run**: shapes shrunk (V/128, D/32), small N, short timing. A "
                  "smoke test of the runner; the figures are not representative.", ""]
    timing = (common.do_bench_text(info.timing)
              + ", ms; forward+backward = torch.autograd.grad(loss, (E, C))"
              if common.uses_cuda(env["device"]) else common.WALL_CLOCK_TIMING)
    settings = [
        *common.environment_rows(env, info.peer_versions),
        ("N, dtype, seed", f"{', '.join(map(str, info.n))} tokens, {info.dtype}, seed {info.seed}"),
        common.matmul_row(info.matmul), ("timing", timing), ("products", PRODUCTS_DEFINITION),
        ("memory", MEMORY_DEFINITION), ("gradient error", ERROR_DEFINITION),
        ("inputs", INPUTS_DEFINITION),
    ]
    lines += [common.markdown_table(["setting", "value"], settings), "",
              "## Time and memory", "",
              "Median ms / peak MiB above inputs and gradient buffers (× products), "
              "forward+backward and forward only side by side; 'products' is the ms of the "
              "cuBLAS products alone.", "", _time_table(case_results), "",
              "## Cases: floors, products, gradient accuracy bar", "",
              f"Floors at the measured R = {common.format_tflops(tflops)} TFLOP/s (docs/design.md):"
              " "
              "'× floor' divides a time by 2NVD/R (forward only) or 8NVD/R (forward+backward; "
              "methods storing the N×V logits need only 6NVD/R). torch bf16: torch eager's "
              "relative L2 error dE / dC, the bar of 'err ratio'.", ""]
    rows = [[cr.case.label, *(common.format_ms(cr.floors_ms[f]) for f in FLOORS),
             f"{common.format_ms(cr.products['ms'])} ({cr.products['method']})",
             common.fastest_cell(cr.results.values()),
             _pair(cr.yardstick["dE"], cr.yardstick["dC"], ".1e") if cr.case.with_backward
             else "",
             "—" if cr.reference_loss is None else f"{cr.reference_loss:.5f}"]
            for cr in case_results]
    lines += [common.markdown_table(
        ["case (V, D)", "fwd 2NVD/R", "bwd 6NVD/R", "fwd+bwd 8NVD/R", "products (timed)",
         "fastest measured", "torch bf16 dE / dC", "float64 reference loss"], rows), "",
        "## All figures", ""]
    rows = [[cr.case.key, r.label, r.status, *(cell(r) for _, cell in FIGURE_COLUMNS), r.note]
            for cr in case_results for r in cr.results.values()]
    headers = ["case", "provider", "status", *(h for h, _ in FIGURE_COLUMNS), "note"]
    lines += [common.markdown_table(headers, rows), ""]
    lines += common.closing_sections(info.calls, info.notes)
    return "\n".join(lines)


def _time_table(case_results: Sequence[CaseResult]) -> str:
    """A row per head, regime and N; per mode the products' ms, then each provider's
    ``ms / MiB (×products)``."""
    columns = common.provider_columns(case_results)
    rows: dict[tuple[str, str, int], dict[str, CaseResult]] = {}
    for cr in case_results:
        rows.setdefault((cr.case.shape.label, cr.case.regime, cr.case.n), {})[cr.case.mode] = cr
    modes = [mode for mode in MODES if any(cr.case.mode == mode for cr in case_results)]

    def cell(r: ProviderResult | None) -> str:
        ratio = "" if r is None or r.times_products is None else f" ({r.times_products:.2f}×)"
        return common.time_and_memory_cell(r, "") + ratio

    body = []
    for (head, regime, n), by_mode in rows.items():
        row = [head, regime, str(n)]
        for mode in modes:
            cr = by_mode.get(mode)
            row.append(common.format_ms(cr.products["ms"]) if cr else "")
            row += [cell(cr.results.get(key) if cr else None) for key, _ in columns]
        body.append(row)
    labels = ["products", *(label for _, label in columns)]
    headers = ["head (V, D)", "regime", "N"] + [f"{m}: {lbl}" for m in modes for lbl in labels]
    return common.markdown_table(headers, body)


def results_json(info: RunInfo, case_results: Sequence[CaseResult]) -> dict[str, Any]:
    settings = {"n": info.n, "dtype": info.dtype, "seed": info.seed, "quick": info.quick,
                "warmup_ms": info.timing.warmup_ms, "rep_ms": info.timing.rep_ms,
                "providers": info.providers}
    definitions = {
        "memory": MEMORY_DEFINITION, "products": PRODUCTS_DEFINITION,
        "gradient_error": ERROR_DEFINITION,
        "floors": "forward 2NVD/R, backward unskipped 6NVD/R, forward+backward 8NVD/R",
        "check": f"|loss − ref| ≤ {LOSS_TOLERANCE}·max(1, |ref|) and dE, dC relative "
        f"error ≤ {GRADIENT_ERROR_BOUND}; failing rows have status 'wrong'",
    }
    cases = [{"case": cr.case.key, "shape": cr.case.shape.name,
              "vocab_size": cr.case.shape.vocab_size, "hidden_size": cr.case.shape.hidden_size,
              "softcap": cr.case.shape.softcap, "n": cr.case.n, "regime": cr.case.regime,
              "mode": cr.case.mode, "floors_ms": cr.floors_ms, "products": dict(cr.products),
              "reference_loss": cr.reference_loss, "torch_bf16_error": dict(cr.yardstick),
              "results": [asdict(r) for r in cr.results.values()]}
             for cr in case_results]
    return {"suite": NAME, "environment": info.environment, "settings": settings,
            "matmul": info.matmul, "peer_versions": info.peer_versions,
            "definitions": definitions, "cases": cases, "calls": info.calls, "notes": info.notes}


def short_tables(case_results: Sequence[CaseResult]) -> str:
    """The terminal summary: per case a products line, then a line per provider."""
    rows = []
    for cr in case_results:
        rows.append([cr.case.key, f"products ({cr.products['method']})",
                     common.format_ms(cr.products["ms"]), "", "1.00", "", "", "", ""])
        for r in cr.results.values():
            case_key, label, ms, mib, times_floor = common.summary_cells(cr.case.key, r)
            rows.append([case_key, label, ms, mib, common.format_ratio(r.times_products),
                         times_floor, _pair(r.ratio_hidden, r.ratio_classifier), _skipped(r),
                         (PASS if r.status == OK else FAIL) if r.measured else ""])
    return common.text_table(["case", "provider", "ms", "MiB", "× products", "× floor",
                              "err ratio dE/dC", "skipped", "check"], rows)


def token_counts(text: str) -> list[int]:
    """``--n``: a comma list of positive token counts, e.g. ``4096,16384``."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers (4096,16384), got {text!r}")
    return list(dict.fromkeys(counts))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    keys = list(lm_head_providers())
    add = parser.add_argument
    add("--shapes", type=common.comma_list(list(LM_HEAD_SHAPES)),
        help=f"comma list of {', '.join(LM_HEAD_SHAPES)}")
    add("--regimes", type=common.comma_list([*REGIMES, TRAINED_REGIME]),
        help="comma list of peaked, flat, trained (default with --shapes/--modes: peaked); "
        "trained: a small GPT trained on real text, from `python -m benchmarks.trained_lm "
        "--out DIR` (see --trained-lm)")
    add("--trained-lm", help=f"the trained regime's directory or file (default ${TRAINED_LM_ENV})")
    add("--modes", type=common.comma_list(MODES),
        help="comma list of fwd+bwd, fwd (default with --shapes/--regimes: fwd+bwd)")
    add("--providers", type=common.comma_list(keys), default=keys,
        help=f"comma list of {', '.join(keys)} (default: all)")
    add("--n", type=token_counts, help="comma list of token counts N, e.g. 4096,16384 "
        f"(default {DEFAULT_N}; {QUICK_N} with --quick)")
    common.add_dtype_seed_arguments(parser)
    common.add_quick_device_timing_arguments(
        parser, "tiny shapes and short timing: a smoke test that also runs on CPU")
    common.add_matmul_output_arguments(parser)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    device = common.pick_device(args.device)
    if not common.uses_cuda(device) and not args.quick:
        log("the lm-head suite needs a CUDA device at full size; use --quick for a CPU smoke run")
        return 2
    quick, dtype = bool(args.quick), common.parse_dtype(args.dtype)
    ns = args.n or [QUICK_N if quick else DEFAULT_N]
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
    log(f"lm-head on {environment['device_name']}: torch {environment['torch']}, "
        f"triton {environment['triton']}, N={','.join(map(str, ns))}, "
        f"{common.dtype_name(dtype)}, {len(cases)} cases")
    matmul = common.probe_matmul(device, args.matmul_size, quick, timing, dtype, log)

    providers = [lm_head_providers()[key] for key in args.providers]
    case_results = run_cases(
        cases, providers, device=device, dtype=dtype, seed=args.seed, timing=timing,
        tflops=matmul["tflops"], log=log, trained_lm=args.trained_lm)
    calls: dict[str, str] = {}
    for cr in case_results:
        for result in cr.results.values():
            if result.call:
                calls.setdefault(result.label, result.call)
            common.note_problem(notes, cr.case.key, result)
        if cr.yardstick["note"]:
            notes.append(f"{cr.case.key}: {cr.yardstick['note']}")
    info = RunInfo(
        environment=environment, matmul=matmul, n=ns, dtype=common.dtype_name(dtype),
        seed=args.seed, quick=quick, timing=timing, providers=list(args.providers),
        peer_versions={name: common.package_version(name)
                       for name in ("cut-cross-entropy", "liger-kernel")},
        calls=calls, notes=notes)
    common.report_results(args.out, RESULTS_PREFIX, args.tag, info.environment, info.notes,
                          markdown=render_markdown(info, case_results),
                          payload=results_json(info, case_results),
                          tables=short_tables(case_results), log=log)
    return 0


SUITE = Suite(name=NAME, run=run, add_arguments=add_arguments,
              help="linear cross-entropy of an LM head (llama3, qwen2.5, gemma2, phi3.5 shapes)")
