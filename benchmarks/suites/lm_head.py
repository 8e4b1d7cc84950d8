"""Suite ``lm-head``: linear cross-entropy of an LM head, ours against torch and the peers.

Per case (shape × regime × N × mode) and provider: an untimed check (loss and gradients
against a float64 reference, tiles skipped by fusedloss's filter; it also compiles), peak
memory, and the ``do_bench`` median with its ratio to the cuBLAS "products" of the case.
Everything applies the head's logit soft-cap; torch eager in the input dtype is the accuracy
yardstick.
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
from benchmarks.common import (
    FAIL,
    NOT_INSTALLED,
    OK,
    PASS,
    UNAVAILABLE,
    TimingSettings,
)
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
from benchmarks.providers import (
    LMHeadProvider,
    Unavailable,
    lm_head_providers,
    torch_eager_loss,
)
from benchmarks.suites import Suite

NAME = "lm-head"
RESULTS_PREFIX = "lm_head"
MODES = ("fwd+bwd", "fwd")
DEFAULT_N = 8192
DEFAULT_CASES: tuple[tuple[str, str, str], ...] = (
    ("gemma2-2b", "peaked", "fwd+bwd"),
    ("gemma2-2b", "flat", "fwd+bwd"),
    ("llama3-8b", "peaked", "fwd+bwd"),
    ("phi3.5", "peaked", "fwd+bwd"),
    ("gemma2-2b", "peaked", "fwd"),
)

# Sanity bounds of the correctness check: they catch a broken provider, not inaccuracy.
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

FUSEDLOSS = "fusedloss"


# ----------------------------------------------------------------------------- cases

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
        mode = ", forward only" if self.mode == "fwd" else ""
        return f"{self.shape.label} {self.regime}, N {self.n}{mode}"

    @property
    def with_backward(self) -> bool:
        return self.mode == "fwd+bwd"

    def floors_ms(self, tflops: float) -> dict[str, float]:
        """Cost floors of docs/design.md at a matmul rate of ``tflops``: 2NVD/R, 6NVD/R, 8NVD/R."""
        nvd = self.n * self.shape.vocab_size * self.shape.hidden_size
        return {floor: flops * nvd * 1e3 / (tflops * 1e12) for floor, flops in FLOORS.items()}

    def floor_ms(self, tflops: float) -> float:
        """The floor this case's time is compared with (no skipping for fwd+bwd)."""
        floors = self.floors_ms(tflops)
        return floors["forward_backward_unskipped" if self.with_backward else "forward"]


def select_cases(
    shapes: Sequence[str] | None,
    regimes: Sequence[str] | None,
    modes: Sequence[str] | None,
    ns: Sequence[int],
    quick: bool,
    trained_lm: str | None = None,
) -> list[Case]:
    """The default cases, or the product of the chosen shapes × regimes × modes; each at
    every N of ``ns``, in the order they run (shape, regime, N, then mode).

    An axis left unchosen while another is chosen defaults to: every shape, "peaked",
    "fwd+bwd". The "trained" regime is one case per N and mode at the trained model's own
    head (``trained_lm``: its file or directory, else ``$FUSEDLOSS_TRAINED_LM``), its first
    min(n, rows) rows, whatever the shapes chosen.
    """
    if shapes is None and regimes is None and modes is None:
        triples = list(DEFAULT_CASES)
    else:
        triples = [
            (s, r, m)
            for s in (shapes or list(LM_HEAD_SHAPES))
            for r in (regimes or ["peaked"])
            for m in (modes or ["fwd+bwd"])
        ]
    cases = {}  # (shape, regime, N) → its cases, so that a group's cases stay together
    for shape_name, regime, mode in triples:
        if regime == TRAINED_REGIME:
            continue  # its shape is the trained model's: below
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


# ----------------------------------------------------------------------------- reference


@dataclass
class Reference:
    loss: float
    grad_hidden: Tensor | None  # dE, float64 (N, D)
    grad_classifier: Tensor | None  # dC, float64 (V, D)


def reference_float64(
    hidden: Tensor,
    classifier: Tensor,
    labels: Tensor,
    with_grads: bool,
    rows_per_chunk: int = 0,
    softcap: float | None = None,
) -> Reference:
    """Mean cross-entropy of ``hidden @ classifier.T`` (soft-capped: ``s·tanh(z/s)`` for
    ``softcap`` s) and its gradients, in float64.

    A block of rows at a time (default ≤1024 rows and ≤2 GiB of float64 logits, twice that
    with a soft-cap): dE per block, dC accumulated over blocks.
    """
    n, _ = hidden.shape
    vocab = classifier.shape[0]
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
            rows = torch.arange(stop - start, device=hidden.device)
            probabilities[rows, block_labels] -= 1.0
            probabilities /= n
            if slope is not None:
                probabilities *= slope
            grad_hidden[start:stop] = probabilities @ classifier64
            grad_classifier.addmm_(probabilities.T, block)
        del logits, lse, block, slope
    return Reference(float(total) / n, grad_hidden, grad_classifier)


@dataclass
class Yardstick:
    """torch eager's gradient errors in the input dtype: the accuracy bar."""

    err_hidden: float | None = None
    err_classifier: float | None = None
    note: str = ""


def measure_yardstick(
    hidden: Tensor,
    classifier: Tensor,
    labels: Tensor,
    reference: Reference,
    softcap: float | None = None,
) -> Yardstick:
    try:
        loss = torch_eager_loss(hidden, classifier, labels, softcap)
        grad_hidden, grad_classifier = torch.autograd.grad(loss, (hidden, classifier))
        del loss
        return Yardstick(
            common.relative_l2_error(grad_hidden, reference.grad_hidden),
            common.relative_l2_error(grad_classifier, reference.grad_classifier),
        )
    except Exception as error:  # an OOM here must not end the run
        return Yardstick(note=f"torch eager yardstick unavailable: {common.describe_error(error)}")


# ----------------------------------------------------------------------------- products


@dataclass
class Products:
    """The products yardstick of one case (:data:`PRODUCTS_DEFINITION`)."""

    ms: float | None = None
    rows_per_chunk: int | None = None  # N when timed whole
    method: str = ""  # "whole" or "16 chunks of 16384 rows"
    note: str = ""  # why it is missing


def products_chunk_rows(
    n: int, vocab: int, with_backward: bool, element_size: int, device: torch.device
) -> int:
    """Rows per chunk of the products: N while the (N, V) Z (and G) take at most
    :data:`PRODUCTS_MEMORY_SHARE` of the free device memory, else :data:`PRODUCTS_CHUNK_ROWS`."""
    if n <= PRODUCTS_CHUNK_ROWS or not common.uses_cuda(device):
        return n
    needed = (2 if with_backward else 1) * n * vocab * element_size
    free, _ = torch.cuda.mem_get_info(device)
    return n if needed <= PRODUCTS_MEMORY_SHARE * free else PRODUCTS_CHUNK_ROWS


def products_function(
    hidden: Tensor, classifier: Tensor, with_backward: bool, rows_per_chunk: int
) -> Callable[[], None]:
    """One call = the products of :data:`PRODUCTS_DEFINITION` over all N rows, taken
    ``rows_per_chunk`` rows at a time; the output buffers and G are allocated here, once."""
    e, c = hidden.detach(), classifier.detach()
    n, vocab = e.shape[0], c.shape[0]
    rows = min(n, rows_per_chunk)
    z = e.new_empty(rows, vocab)
    if with_backward:
        generator = torch.Generator(device=e.device).manual_seed(0)
        g = e.new_empty(rows, vocab).normal_(generator=generator)  # no zeros: a dense gradient
        grad_hidden, grad_classifier = torch.empty_like(e), torch.empty_like(c)

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

    return products


def time_products(
    hidden: Tensor,
    classifier: Tensor,
    with_backward: bool,
    timing: TimingSettings,
    rows_per_chunk: int | None = None,
) -> Products:
    """Median ms of :func:`products_function` (``rows_per_chunk`` default:
    :func:`products_chunk_rows`); an error (out of memory) leaves ``ms`` None with a note."""
    n, device = hidden.shape[0], hidden.device
    rows = rows_per_chunk or products_chunk_rows(
        n, classifier.shape[0], with_backward, hidden.element_size(), device)
    chunks = -(-n // rows)
    result = Products(
        rows_per_chunk=rows, method="whole" if chunks == 1 else f"{chunks} chunks of {rows} rows")
    try:
        result.ms = common.median_ms(
            products_function(hidden, classifier, with_backward, rows), device, timing)
    except Exception as error:  # an OOM here must not end the run
        result.note = f"products not timed: {common.describe_error(error)}"
    if common.uses_cuda(device):
        torch.cuda.empty_cache()  # G and the outputs, freed with the function, leave the cache
    return result


# ----------------------------------------------------------------------------- results


@dataclass
class ProviderResult(common.ProviderResultBase):
    """One provider on one case: the fields every suite records, then these figures."""

    peak_extra_mib: float | None = None
    loss: float | None = None
    loss_error: float | None = None  # |loss − float64 reference|
    err_hidden: float | None = None  # relative L2 error of dE
    err_classifier: float | None = None  # relative L2 error of dC
    ratio_hidden: float | None = None  # err_hidden ÷ torch-bf16's
    ratio_classifier: float | None = None
    times_floor: float | None = None  # ms ÷ the case's floor
    times_products: float | None = None  # ms ÷ the case's products
    tiles_skipped: float | None = None  # fusedloss's Triton backward: share of tiles skipped


@dataclass
class CaseResult:
    case: Case
    floors_ms: dict[str, float]
    reference_loss: float | None
    yardstick: Yardstick
    results: dict[str, ProviderResult] = field(default_factory=dict)
    products: Products = field(default_factory=Products)


def run_provider(
    provider: LMHeadProvider,
    case: Case,
    inputs: tuple[Tensor, Tensor, Tensor],
    reference: Reference,
    yardstick: Yardstick,
    timing: TimingSettings,
    floor_ms: float | None,
    products_ms: float | None = None,
) -> ProviderResult:
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

    def forward_only() -> Tensor:
        # evaluation: no autograd graph (a loss that forms its gradient in the forward when
        # gradients are wanted must not do so here)
        with torch.no_grad():
            return forward()

    def forward_backward() -> tuple[Tensor, ...]:
        return torch.autograd.grad(loss_fn(hidden, classifier, labels), (hidden, classifier))

    with common.failures_recorded(result, device):
        _check(result, forward, (hidden, classifier), case, reference, yardstick)
        common.release_memory(device)
        if case.with_backward:
            gradient_bytes = (hidden.numel() + classifier.numel()) * hidden.element_size()
            result.peak_extra_mib = common.peak_extra_mib(forward_backward, device, gradient_bytes)
        else:
            result.peak_extra_mib = common.peak_extra_mib(forward_only, device)
        timed = forward_backward if case.with_backward else forward_only
        result.ms = common.median_ms(timed, device, timing)
        if floor_ms:
            result.times_floor = result.ms / floor_ms
        if products_ms:
            result.times_products = result.ms / products_ms
    return result


def _check(
    result: ProviderResult,
    forward: Callable[[], Tensor],
    leaves: tuple[Tensor, Tensor],
    case: Case,
    reference: Reference,
    yardstick: Yardstick,
) -> None:
    """First (untimed) call: loss and gradients against the float64 reference."""
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
        if yardstick.err_hidden:
            result.ratio_hidden = result.err_hidden / yardstick.err_hidden
        if yardstick.err_classifier:
            result.ratio_classifier = result.err_classifier / yardstick.err_classifier
        for name, error in (("dE", result.err_hidden), ("dC", result.err_classifier)):
            if not error <= GRADIENT_ERROR_BOUND:  # also catches NaN
                problems.append(f"{name} relative error {error:.2e} > {GRADIENT_ERROR_BOUND}")
    result.loss = float(loss.detach().float())
    del loss
    result.loss_error, loss_problems = common.check_loss(
        result.loss, reference.loss, LOSS_TOLERANCE
    )
    common.mark_wrong(result, problems + loss_problems)


def run_cases(
    cases: Sequence[Case],
    providers: Sequence[LMHeadProvider],
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    timing: TimingSettings,
    tflops: float,
    log: Callable[[str], None] = print,
    trained_lm: str | None = None,
) -> list[CaseResult]:
    """Run every provider on every case; cases sharing inputs share one reference."""
    case_results: list[CaseResult] = []
    groups: dict[tuple[str, str, int], list[Case]] = {}
    for case in cases:
        groups.setdefault((case.shape.name, case.regime, case.n), []).append(case)
    for group in groups.values():
        first = group[0]
        if first.regime == TRAINED_REGIME:
            hidden, classifier, labels, _ = load_trained_regime(
                trained_lm, device=device, dtype=dtype, n=first.n)
        else:
            hidden, classifier, labels = make_lm_head_inputs(
                first.n, first.shape.vocab_size, first.shape.hidden_size, first.regime,
                dtype=dtype, device=device, seed=seed)
        hidden.requires_grad_(True)
        classifier.requires_grad_(True)
        with_grads = any(case.with_backward for case in group)
        softcap = first.shape.softcap
        reference = reference_float64(hidden, classifier, labels, with_grads, softcap=softcap)
        yardstick = (
            measure_yardstick(hidden, classifier, labels, reference, softcap)
            if with_grads
            else Yardstick()
        )
        common.release_memory(device)
        log(
            f"[{first.shape.label} {first.regime}, N {first.n}]: reference loss "
            f"{reference.loss:.4f} "
            f"(log V = {math.log(first.shape.vocab_size):.2f}); torch bf16 error dE "
            f"{common.format_error(yardstick.err_hidden)}, dC "
            f"{common.format_error(yardstick.err_classifier)} {yardstick.note}".rstrip()
        )
        for case in group:
            case_result = CaseResult(
                case,
                case.floors_ms(tflops),
                reference.loss,
                yardstick if case.with_backward else Yardstick(),
                products=time_products(hidden, classifier, case.with_backward, timing),
            )
            products = case_result.products
            log(f"  {case.key:<34} {'products (' + products.method + ')':<34} "
                f"{common.format_ms(products.ms)} ms {products.note}".rstrip())
            for provider in providers:
                outcome = run_provider(
                    provider,
                    case,
                    (hidden, classifier, labels),
                    reference,
                    case_result.yardstick,
                    timing,
                    case.floor_ms(tflops),
                    products.ms,
                )
                case_result.results[provider.key] = outcome
                progress = common.progress_line(outcome, _figures_text)
                log(f"  {case.key:<34} {outcome.label:<34} {progress}")
            case_results.append(case_result)
        del hidden, classifier, labels, reference
        common.release_memory(device)
    return case_results


def _figures_text(result: ProviderResult) -> str:
    text = (
        f"{common.format_ms(result.ms)} ms ({common.format_ratio(result.times_products)}× "
        f"products), {common.format_mib(result.peak_extra_mib)} MiB, "
        f"loss err {result.loss_error:.1e}"
    )
    if result.err_hidden is not None:
        text += f", dE {result.err_hidden:.1e}, dC {result.err_classifier:.1e}"
    return text


# ----------------------------------------------------------------------------- reports


@dataclass(kw_only=True)
class RunInfo(common.RunInfoBase):
    """The run's settings (:class:`common.RunInfoBase`) and its token counts N."""

    n: list[int]


def _error_cell(result: ProviderResult | None) -> str:
    if result is None or result.err_hidden is None:
        return "" if result is None else (result.status if not result.measured else "—")
    text = f"{result.err_hidden:.1e} / {result.err_classifier:.1e}"
    if result.ratio_hidden is not None and result.ratio_classifier is not None:
        text += f" ({result.ratio_hidden:.2f}× / {result.ratio_classifier:.2f}×)"
    return text


def _ratio_cell(result: ProviderResult) -> str:
    if result.ratio_hidden is None or result.ratio_classifier is None:
        return "—"
    return f"{result.ratio_hidden:.2f} / {result.ratio_classifier:.2f}"


def render_markdown(info: RunInfo, case_results: Sequence[CaseResult]) -> str:
    env = info.environment
    tflops = info.matmul["tflops"]
    title = f"# LM-head linear cross-entropy: {env['device_name']}, {env['date']}"
    lines = [title, ""]
    if info.quick:
        lines += [
            "> **--quick run**: shapes shrunk (V/128, D/32), small N, short timing. A smoke "
            "test of the runner; the figures are not representative.",
            "",
        ]
    header_rows = [
        *common.environment_rows(env, info.peer_versions),
        ("N, dtype, seed", f"{', '.join(map(str, info.n))} tokens, {info.dtype}, seed {info.seed}"),
        common.matmul_row(info.matmul),
        (
            "timing",
            common.do_bench_text(info.timing)
            + ", ms; forward+backward = torch.autograd.grad(loss, (E, C))"
            if common.uses_cuda(env["device"])
            else common.WALL_CLOCK_TIMING,
        ),
        ("products", PRODUCTS_DEFINITION),
        ("memory", MEMORY_DEFINITION),
        ("gradient error", ERROR_DEFINITION),
        (
            "inputs",
            "C = randn(V, D)/√D; y = randint(0, V, (N,)); flat: E = randn(N, D); peaked: "
            "E = 13·C[y] + 2·randn(N, D), then C[:, 0] = −log(rank)/4 (rank a random "
            "permutation of 1..V), E[:, 0] = 4; both cast to the dtype afterwards",
        ),
    ]
    lines += [common.markdown_table(["setting", "value"], header_rows), ""]

    columns = common.provider_columns(case_results)
    lines += [
        "## Time and memory",
        "",
        "Median ms / peak MiB above inputs and gradient buffers (× products), forward+backward "
        "and forward only side by side; 'products' is the ms of the cuBLAS products alone.",
        "",
        _time_table(case_results, columns),
        "",
    ]

    backward_cases = [cr for cr in case_results if cr.case.with_backward]
    if backward_cases:
        lines += [
            "## Gradient accuracy",
            "",
            "Relative L2 error dE / dC against the float64 reference (err ratio ÷ torch bf16 "
            "in parentheses).",
            "",
        ]
        rows = [
            [
                cr.case.label,
                f"{common.format_error(cr.yardstick.err_hidden)} / "
                f"{common.format_error(cr.yardstick.err_classifier)}",
            ]
            + [_error_cell(cr.results.get(key)) for key, _ in columns]
            for cr in backward_cases
        ]
        headers = ["case (V, D)", "torch bf16 (yardstick)"] + [lbl for _, lbl in columns]
        lines += [common.markdown_table(headers, rows), ""]

    lines += [
        "## Cost floors (docs/design.md)",
        "",
        f"At the measured R = {common.format_tflops(tflops)} TFLOP/s: forward 2NVD/R, "
        "backward with nothing skipped 6NVD/R, so forward+backward unskipped 8NVD/R. "
        "'× floor' in the details divides a time by 2NVD/R (forward only) or 8NVD/R "
        "(forward+backward). Methods that store the N×V logits instead of recomputing them "
        "(torch eager, torch.compile) need only 6NVD/R for forward+backward.",
        "",
    ]
    rows = [
        [cr.case.label]
        + [common.format_ms(cr.floors_ms[floor]) for floor in FLOORS]
        + [f"{common.format_ms(cr.products.ms)} ({cr.products.method})",
           common.fastest_cell(cr.results.values())]
        for cr in case_results
    ]
    headers = ["case (V, D)", "fwd 2NVD/R", "bwd 6NVD/R", "fwd+bwd 8NVD/R", "products (timed)",
               "fastest measured"]
    lines += [common.markdown_table(headers, rows), ""]

    lines += ["## All figures", ""]
    rows = [
        [cr.case.key, result.label, result.status, common.format_ms(result.ms),
         common.format_ratio(result.times_products), common.format_ratio(result.times_floor),
         common.format_mib(result.peak_extra_mib), *common.loss_cells(result),
         common.format_error(result.err_hidden), common.format_error(result.err_classifier),
         _ratio_cell(result), _skipped_cell(result), result.note]
        for cr in case_results
        for result in cr.results.values()
    ]
    headers = ["case", "provider", "status", "ms", "× products", "× floor", "MiB", "loss",
               "|loss − ref|", "dE err", "dC err", "err ratio dE / dC", "tiles skipped", "note"]
    lines += [common.markdown_table(headers, rows), ""]
    ref_rows = [[cr.case.key, f"{cr.reference_loss:.5f}"]
                for cr in case_results if cr.reference_loss is not None]
    lines += [common.markdown_table(["case", "float64 reference loss"], ref_rows), ""]
    lines += common.closing_sections(info.calls, info.notes)
    return "\n".join(lines)


def _time_table(case_results: Sequence[CaseResult], columns: Sequence[tuple[str, str]]) -> str:
    """One row per head, regime and N; per mode, the products' ms then every provider's
    ``ms / MiB (×products)``."""
    rows: dict[tuple[str, str, int], dict[str, CaseResult]] = {}
    for cr in case_results:
        rows.setdefault((cr.case.shape.label, cr.case.regime, cr.case.n), {})[cr.case.mode] = cr
    modes = [mode for mode in MODES if any(cr.case.mode == mode for cr in case_results)]

    def cell(result: ProviderResult | None) -> str:
        text = common.time_and_memory_cell(result, "")
        if result is not None and result.times_products is not None:
            text += f" ({result.times_products:.2f}×)"
        return text

    body = []
    for (head, regime, n), by_mode in rows.items():
        row = [head, regime, str(n)]
        for mode in modes:
            cr = by_mode.get(mode)
            row.append(common.format_ms(cr.products.ms) if cr else "")
            row += [cell(cr.results.get(key) if cr else None) for key, _ in columns]
        body.append(row)
    labels = ["products", *(label for _, label in columns)]
    headers = ["head (V, D)", "regime", "N"] + [f"{m}: {lbl}" for m in modes for lbl in labels]
    return common.markdown_table(headers, body)


def _skipped_cell(result: ProviderResult) -> str:
    """The share of the backward's tiles that filtering skipped (fusedloss's Triton path)."""
    return "—" if result.tiles_skipped is None else f"{100 * result.tiles_skipped:.2f}%"


def results_json(info: RunInfo, case_results: Sequence[CaseResult]) -> dict[str, Any]:
    return {
        "suite": NAME,
        "environment": info.environment,
        "settings": {
            "n": info.n, "dtype": info.dtype, "seed": info.seed, "quick": info.quick,
            "warmup_ms": info.timing.warmup_ms, "rep_ms": info.timing.rep_ms,
            "providers": info.providers,
        },
        "matmul": info.matmul,
        "peer_versions": info.peer_versions,
        "definitions": {
            "memory": MEMORY_DEFINITION,
            "products": PRODUCTS_DEFINITION,
            "gradient_error": ERROR_DEFINITION,
            "floors": "forward 2NVD/R, backward unskipped 6NVD/R, forward+backward 8NVD/R",
            "check": f"|loss − ref| ≤ {LOSS_TOLERANCE}·max(1, |ref|) and dE, dC relative "
            f"error ≤ {GRADIENT_ERROR_BOUND}; failing rows have status 'wrong'",
        },
        "cases": [
            {
                "case": cr.case.key, "shape": cr.case.shape.name,
                "vocab_size": cr.case.shape.vocab_size, "hidden_size": cr.case.shape.hidden_size,
                "softcap": cr.case.shape.softcap, "n": cr.case.n, "regime": cr.case.regime,
                "mode": cr.case.mode, "floors_ms": cr.floors_ms, "products": asdict(cr.products),
                "reference_loss": cr.reference_loss,
                "torch_bf16_error": {"dE": cr.yardstick.err_hidden,
                                     "dC": cr.yardstick.err_classifier,
                                     "note": cr.yardstick.note},
                "results": [asdict(r) for r in cr.results.values()],
            }
            for cr in case_results
        ],
        "calls": info.calls,
        "notes": info.notes,
    }


def short_tables(case_results: Sequence[CaseResult]) -> str:
    """The terminal summary: per case a line for the products and one per provider."""
    rows = []
    for cr in case_results:
        products = f"products ({cr.products.method})"
        rows.append([cr.case.key, products, common.format_ms(cr.products.ms), "", "1.00", "",
                     "", "", ""])
        for result in cr.results.values():
            case_key, label, ms, mib, times_floor = common.summary_cells(cr.case.key, result)
            rows.append([
                case_key, label, ms, mib, common.format_ratio(result.times_products), times_floor,
                _ratio_cell(result), _skipped_cell(result),
                (PASS if result.status == OK else FAIL) if result.measured else ""])
    headers = ["case", "provider", "ms", "MiB", "× products", "× floor", "err ratio dE/dC",
               "skipped", "check"]
    return common.text_table(headers, rows)


# ----------------------------------------------------------------------------- command line


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
    provider_keys = list(lm_head_providers())
    parser.add_argument("--shapes", type=common.comma_list(list(LM_HEAD_SHAPES)),
                        help=f"comma list of {', '.join(LM_HEAD_SHAPES)}")
    parser.add_argument(
        "--regimes", type=common.comma_list([*REGIMES, TRAINED_REGIME]),
        help="comma list of peaked, flat, trained (default with --shapes/--modes: peaked); "
        "trained: the hidden states, head and targets of a small GPT trained on real text, "
        "made by `python -m benchmarks.trained_lm --out DIR` (see --trained-lm)")
    parser.add_argument("--trained-lm", default=None, help="the trained regime's directory or "
                        f"file (default ${TRAINED_LM_ENV})")
    parser.add_argument("--modes", type=common.comma_list(MODES), help="comma list of fwd+bwd, "
                        "fwd (default with --shapes/--regimes: fwd+bwd)")
    parser.add_argument("--providers", type=common.comma_list(provider_keys),
                        default=provider_keys,
                        help=f"comma list of {', '.join(provider_keys)} (default: all)")
    parser.add_argument("--n", type=token_counts, default=None,
                        help="comma list of token counts N, e.g. 4096,16384 (default "
                        f"{DEFAULT_N}; {QUICK_N} with --quick)")
    common.add_dtype_seed_arguments(parser)
    common.add_quick_device_timing_arguments(
        parser, "tiny shapes and short timing: a smoke test that also runs on CPU")
    common.add_matmul_output_arguments(parser)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    device = common.pick_device(args.device)
    if not common.uses_cuda(device) and not args.quick:
        log("the lm-head suite needs a CUDA device at full size; use --quick for a CPU smoke run")
        return 2
    quick = bool(args.quick)
    ns = args.n or [QUICK_N if quick else DEFAULT_N]
    dtype = common.parse_dtype(args.dtype)
    timing = common.timing_settings(args.warmup_ms, args.rep_ms, quick)
    notes: list[str] = [common.QUICK_NOTE] if quick else []
    if not common.uses_cuda(device) and any(p.startswith(FUSEDLOSS) for p in args.providers):
        notes.append(common.use_triton_interpreter())

    all_providers = lm_head_providers()
    providers = [all_providers[key] for key in args.providers]
    try:
        cases = select_cases(args.shapes, args.regimes, args.modes, ns, quick, args.trained_lm)
    except FileNotFoundError as error:
        log(str(error))
        return 2
    environment = common.collect_environment(device)
    log(
        f"lm-head on {environment['device_name']}: torch {environment['torch']}, "
        f"triton {environment['triton']}, N={','.join(map(str, ns))}, "
        f"{common.dtype_name(dtype)}, {len(cases)} cases"
    )
    matmul = common.probe_matmul(device, args.matmul_size, quick, timing, dtype, log)

    case_results = run_cases(
        cases, providers, device=device, dtype=dtype, seed=args.seed, timing=timing,
        tflops=matmul["tflops"], log=log, trained_lm=args.trained_lm)

    calls: dict[str, str] = {}
    for cr in case_results:
        for result in cr.results.values():
            if result.call:
                calls.setdefault(result.label, result.call)
            common.note_problem(notes, cr.case.key, result)
        if cr.yardstick.note:
            notes.append(f"{cr.case.key}: {cr.yardstick.note}")
    info = RunInfo(
        environment=environment, matmul=matmul, n=ns, dtype=common.dtype_name(dtype),
        seed=args.seed, quick=quick, timing=timing, providers=list(args.providers),
        peer_versions={name: common.package_version(name)
                       for name in ("cut-cross-entropy", "liger-kernel")},
        calls=calls, notes=notes)
    common.report_results(
        args.out, RESULTS_PREFIX, args.tag, info,
        markdown=render_markdown(info, case_results),
        payload=results_json(info, case_results),
        tables=short_tables(case_results), log=log)
    return 0


SUITE = Suite(
    name=NAME,
    help="linear cross-entropy of an LM head (llama3, qwen2.5, gemma2, phi3.5 shapes)",
    add_arguments=add_arguments,
    run=run,
)
