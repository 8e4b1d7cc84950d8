"""Suite ``lm-head``: linear cross-entropy of an LM head, ours against torch and the peers.

For every case (shape × regime × mode) and provider, one run records:

- a correctness check (untimed; it is also the warm-up that compiles ``torch.compile``):
  loss against a float64 reference, gradients' relative L2 errors (forward+backward), and
  for fusedloss's Triton backward the share of its tiles that filtering skipped in that call;
- peak device memory above inputs and gradient buffers (:data:`MEMORY_DEFINITION`);
- the median time of ``do_bench`` (forward, or forward+backward w.r.t. E and C).

The float64 reference is computed a block of rows at a time on the benchmark device
(:func:`reference_float64`); torch eager in the benchmark dtype is the accuracy yardstick.
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
    TargetOutcome,
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

# Sanity bounds of the correctness check. They catch a broken provider (wrong loss, zero or
# garbage gradients); accuracy itself is judged by the error-ratio target.
LOSS_TOLERANCE = 1e-2  # |loss − reference| ≤ LOSS_TOLERANCE · max(1, |reference|)
GRADIENT_ERROR_BOUND = 5e-2  # relative L2 error of dE and dC

MEMORY_DEFINITION = (
    "peak MB above inputs and gradient buffers = (torch.cuda.max_memory_allocated() during "
    "one call − torch.cuda.memory_allocated() just before it − gradient bytes) / 2^20, where "
    "the call is forward+backward `torch.autograd.grad(loss(E, C, y), (E, C))` (gradient bytes "
    "= (N·D + V·D) × element size of the input dtype: the dE and dC a training step holds "
    "anyway) or forward only `loss(E, C, y)` with E and C requiring grad as in training "
    "(gradient bytes = 0; whatever the forward saves or precomputes for the backward counts). "
    "Inputs E, C, y are allocated before the call; the caching allocator is emptied and the "
    "peak counter reset right before it. MB = 2^20 bytes."
)
ERROR_DEFINITION = (
    "relative L2 error ‖g − g_ref‖₂ / ‖g_ref‖₂ of dE and dC from forward+backward of the mean "
    "loss, against a float64 reference of the same (bf16-rounded) inputs computed on the "
    "benchmark device a block of ≤1024 rows at a time (logits, softmax and dE per block; dC "
    "accumulated in float64), never the full N×V in float64. 'err ratio' = a method's error ÷ "
    "torch eager's error in the input dtype (F.cross_entropy(F.linear(E, C).float(), y)), "
    "given as dE / dC."
)

FUSEDLOSS = "fusedloss"
FUSEDLOSS_EXACT = "fusedloss-exact"
FUSEDLOSS_FILTERED = "fusedloss-filtered"
TORCH_EAGER = "torch-eager"
TORCH_COMPILE = "torch-compile"
CCE_FAMILY = ("cce", "cce-nofilter")
LIGER = "liger"


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    shape: LMHeadShape
    regime: str  # "peaked" | "flat" | "trained"
    mode: str  # "fwd+bwd" | "fwd"
    n: int

    @property
    def key(self) -> str:
        return f"{self.shape.name} {self.regime} {self.mode}"

    @property
    def label(self) -> str:
        mode = ", forward only" if self.mode == "fwd" else ""
        return (
            f"{self.shape.name} ({self.shape.vocab_size}, {self.shape.hidden_size}) "
            f"{self.regime}{mode}"
        )

    @property
    def with_backward(self) -> bool:
        return self.mode == "fwd+bwd"

    def floors_ms(self, tflops: float) -> dict[str, float]:
        """Cost floors of docs/design.md at a matmul rate of ``tflops``: 2NVD/R, 6NVD/R, 8NVD/R."""
        nvd = self.n * self.shape.vocab_size * self.shape.hidden_size
        to_ms = 1e3 / (tflops * 1e12)
        return {
            "forward": 2 * nvd * to_ms,
            "backward_unskipped": 6 * nvd * to_ms,
            "forward_backward_unskipped": 8 * nvd * to_ms,
        }

    def floor_ms(self, tflops: float) -> float:
        """The floor this case's time is compared with (no skipping for fwd+bwd)."""
        floors = self.floors_ms(tflops)
        return floors["forward_backward_unskipped" if self.with_backward else "forward"]


def select_cases(
    shapes: Sequence[str] | None,
    regimes: Sequence[str] | None,
    modes: Sequence[str] | None,
    n: int,
    quick: bool,
    trained_lm: str | None = None,
) -> list[Case]:
    """The default case list, or the product of the chosen shapes × regimes × modes.

    An axis left unchosen while another is chosen defaults to: every shape, "peaked",
    "fwd+bwd". The "trained" regime is one case per mode at the trained model's own head
    (``trained_lm``: its file or directory, else ``$FUSEDLOSS_TRAINED_LM``), its first
    min(n, N) rows, whatever the shapes chosen.
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
    cases = []
    for shape_name, regime, mode in triples:
        if regime == TRAINED_REGIME:
            continue  # its shape is the trained model's: one case per mode, below
        shape = LM_HEAD_SHAPES[shape_name]
        cases.append(Case(quick_shape(shape) if quick else shape, regime, mode, n))
    if TRAINED_REGIME in (regimes or ()):
        shape = trained_shape(trained_lm)
        rows = min(n, trained_rows(trained_lm))
        cases += [Case(shape, TRAINED_REGIME, m, rows) for m in (modes or ["fwd+bwd"])]
    return cases


# ----------------------------------------------------------------------------- reference


@dataclass
class Reference:
    loss: float
    grad_hidden: Tensor | None  # dE, float64 (N, D)
    grad_classifier: Tensor | None  # dC, float64 (V, D)


def reference_float64(
    hidden: Tensor, classifier: Tensor, labels: Tensor, with_grads: bool, rows_per_chunk: int = 0
) -> Reference:
    """Mean cross-entropy of ``hidden @ classifier.T`` and its gradients, in float64.

    Works a block of rows at a time so that at most ``rows × V`` float64 logits exist
    (default: ≤1024 rows and ≤2 GiB of logits): logits → log-sum-exp → softmax − one-hot
    in place → dE of the block, dC accumulated over blocks.
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
        lse = torch.logsumexp(logits, dim=1)
        total += (lse - logits.gather(1, block_labels[:, None]).squeeze(1)).sum()
        if with_grads:
            probabilities = logits.sub_(lse[:, None]).exp_()  # reuses the logits' memory
            rows = torch.arange(stop - start, device=hidden.device)
            probabilities[rows, block_labels] -= 1.0
            probabilities /= n
            grad_hidden[start:stop] = probabilities @ classifier64
            grad_classifier.addmm_(probabilities.T, block)
        del logits, lse, block
    return Reference(float(total) / n, grad_hidden, grad_classifier)


@dataclass
class Yardstick:
    """torch eager's gradient errors in the input dtype: the accuracy bar."""

    err_hidden: float | None = None
    err_classifier: float | None = None
    note: str = ""


def measure_yardstick(
    hidden: Tensor, classifier: Tensor, labels: Tensor, reference: Reference
) -> Yardstick:
    try:
        loss = torch_eager_loss(hidden, classifier, labels)
        grad_hidden, grad_classifier = torch.autograd.grad(loss, (hidden, classifier))
        del loss
        return Yardstick(
            common.relative_l2_error(grad_hidden, reference.grad_hidden),
            common.relative_l2_error(grad_classifier, reference.grad_classifier),
        )
    except Exception as error:  # an OOM here must not end the run
        return Yardstick(note=f"torch eager yardstick unavailable: {common.describe_error(error)}")


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
    tiles_skipped: float | None = None  # fusedloss's Triton backward: share of tiles skipped


@dataclass
class CaseResult:
    case: Case
    floors_ms: dict[str, float]
    reference_loss: float | None
    yardstick: Yardstick
    results: dict[str, ProviderResult] = field(default_factory=dict)


def run_provider(
    provider: LMHeadProvider,
    case: Case,
    inputs: tuple[Tensor, Tensor, Tensor],
    reference: Reference,
    yardstick: Yardstick,
    timing: TimingSettings,
    floor_ms: float | None,
) -> ProviderResult:
    """Check, measure memory, and time one provider on one case."""
    hidden, classifier, labels = inputs
    device = hidden.device
    result = ProviderResult(provider.key, provider.display_name())
    try:
        loss_fn = provider.build(device)
    except Unavailable as error:
        result.status = NOT_INSTALLED if provider.is_peer else UNAVAILABLE
        result.note = str(error)
        return result
    result.call = provider.describe()

    def forward() -> Tensor:
        return loss_fn(hidden, classifier, labels)

    def forward_backward() -> tuple[Tensor, ...]:
        return torch.autograd.grad(loss_fn(hidden, classifier, labels), (hidden, classifier))

    with common.failures_recorded(result, device):
        _check(result, forward, (hidden, classifier), case, reference, yardstick)
        common.release_memory(device)
        if case.with_backward:
            gradient_bytes = (hidden.numel() + classifier.numel()) * hidden.element_size()
            result.peak_extra_mib = common.peak_extra_mib(forward_backward, device, gradient_bytes)
        else:
            result.peak_extra_mib = common.peak_extra_mib(forward, device)
        timed = forward_backward if case.with_backward else forward
        result.ms = common.median_ms(timed, device, timing)
        if floor_ms:
            result.times_floor = result.ms / floor_ms
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
    groups: dict[tuple[str, str], list[Case]] = {}
    for case in cases:
        groups.setdefault((case.shape.name, case.regime), []).append(case)
    for group in groups.values():
        first = group[0]
        if first.regime == TRAINED_REGIME:
            hidden, classifier, labels, _ = load_trained_regime(
                trained_lm, device=device, dtype=dtype, n=first.n)
        else:
            hidden, classifier, labels = make_lm_head_inputs(
                first.n,
                first.shape.vocab_size,
                first.shape.hidden_size,
                first.regime,
                dtype=dtype,
                device=device,
                seed=seed,
            )
        hidden.requires_grad_(True)
        classifier.requires_grad_(True)
        with_grads = any(case.with_backward for case in group)
        reference = reference_float64(hidden, classifier, labels, with_grads)
        yardstick = (
            measure_yardstick(hidden, classifier, labels, reference) if with_grads else Yardstick()
        )
        common.release_memory(device)
        log(
            f"[{first.shape.name} {first.regime}] V={first.shape.vocab_size} "
            f"D={first.shape.hidden_size} N={first.n}: reference loss {reference.loss:.4f} "
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
            )
            for provider in providers:
                outcome = run_provider(
                    provider,
                    case,
                    (hidden, classifier, labels),
                    reference,
                    case_result.yardstick,
                    timing,
                    case.floor_ms(tflops),
                )
                case_result.results[provider.key] = outcome
                progress = common.progress_line(outcome, _figures_text)
                log(f"  {case.key:<28} {outcome.label:<34} {progress}")
            case_results.append(case_result)
        del hidden, classifier, labels, reference
        common.release_memory(device)
    return case_results


def _figures_text(result: ProviderResult) -> str:
    text = (
        f"{common.format_ms(result.ms)} ms, {common.format_mib(result.peak_extra_mib)} MB, "
        f"loss err {result.loss_error:.1e}"
    )
    if result.err_hidden is not None:
        text += f", dE {result.err_hidden:.1e}, dC {result.err_classifier:.1e}"
    return text


# ----------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """One goal of the project issue for one case, as a ratio against a baseline.

    kind "time": provider's ms ≤ factor × the fastest measured baseline provider's ms;
    "memory": provider's MB ≤ factor × baseline's MB; "error": provider's dE and dC errors
    ≤ factor × torch eager's in the input dtype (baselines unused).
    """

    case_key: str
    provider: str
    kind: str
    factor: float
    baselines: tuple[str, ...] = ()
    baseline_label: str = ""

    @property
    def description(self) -> str:
        factor = f"{self.factor:g}" if self.factor % 1 else f"{self.factor:.1f}"
        if self.kind == "time":
            return f"time ≤ {factor}× {self.baseline_label}"
        if self.kind == "memory":
            return f"memory ≤ {self.factor:.0%} of {self.baseline_label}"
        return f"gradient error ≤ {factor}× torch bf16 (dE and dC)"


def targets_for_case(case: Case, providers: Sequence[str]) -> list[Target]:
    """The project's goals that apply to ``case`` for the selected fusedloss providers."""
    targets: list[Target] = []
    compile_label = "torch.compile"
    if FUSEDLOSS in providers:
        speed: list[tuple[float, tuple[str, ...], str]] = []
        if case.mode == "fwd":
            speed.append((1.0, (TORCH_COMPILE,), compile_label))
        elif case.regime == "flat":
            speed.append((1.3, (TORCH_COMPILE,), compile_label))
        elif case.shape.name in ("gemma2-2b", "llama3-8b"):
            speed += [
                (0.7, (TORCH_COMPILE,), compile_label),
                (0.35, CCE_FAMILY, "cut-cross-entropy (faster variant)"),
                (0.35, (LIGER,), "liger-kernel"),
            ]
        elif case.shape.name == "phi3.5":
            speed.append((1.0, (TORCH_COMPILE,), compile_label))
        targets += [
            Target(case.key, FUSEDLOSS, "time", factor, baselines, label)
            for factor, baselines, label in speed
        ]
    if case.with_backward and FUSEDLOSS_EXACT in providers:
        # the default and filtering (with its bookkeeping) must never cost time, on any regime
        targets += [Target(case.key, ours, "time", 1.0, (FUSEDLOSS_EXACT,),
                           "fusedloss exact (filter_eps=None)")
                    for ours in (FUSEDLOSS, FUSEDLOSS_FILTERED) if ours in providers]
    for ours in (FUSEDLOSS, FUSEDLOSS_EXACT, FUSEDLOSS_FILTERED):
        if ours not in providers:
            continue
        targets.append(Target(case.key, ours, "memory", 0.01, (TORCH_COMPILE,), compile_label))
        if case.with_backward:
            # the default and the filtered call: within PyTorch's own bf16 error; the product's
            # bar: 1.5×
            targets.append(Target(case.key, ours, "error",
                                  1.5 if ours == FUSEDLOSS_EXACT else 1.0))
    return targets


def evaluate_target(target: Target, case_result: CaseResult) -> TargetOutcome[Target]:
    """PASS or FAIL, with the ratio against the baseline (error: the worse of dE, dC)."""
    ours = case_result.results.get(target.provider)
    if ours is None:
        return TargetOutcome(target, "n/a (not run)")
    if not ours.measured:
        return TargetOutcome(target, f"{FAIL} ({ours.provider} {ours.status})")
    if target.kind == "error":
        return _evaluate_error(target, ours, case_result.yardstick)

    value_of = common.figure_of(target.kind)
    if value_of(ours) is None:
        return TargetOutcome(target, "n/a (no memory figures without CUDA)")
    candidates = [case_result.results.get(key) for key in target.baselines]
    measured = [r for r in candidates if r is not None and r.measured and value_of(r) is not None]
    if not measured:
        return TargetOutcome(target, _missing_baseline_status(target, candidates))
    baseline = min(measured, key=value_of)
    ratio, text = common.baseline_ratio(target.kind, ours, baseline)
    return TargetOutcome(target, PASS if ratio <= target.factor else FAIL, text, ratio)


def _missing_baseline_status(target: Target, candidates: list[ProviderResult | None]) -> str:
    present = [r for r in candidates if r is not None]
    if not present:
        return f"n/a ({target.baseline_label} not run)"
    if all(r.status == NOT_INSTALLED for r in present):
        return "n/a (peer not installed)"
    if any(r.measured for r in present):  # measured but no figure (memory on CPU)
        return "n/a (no memory figures without CUDA)"
    worst = present[0]
    return f"n/a ({worst.label} {worst.status})"


def _evaluate_error(
    target: Target, ours: ProviderResult, yardstick: Yardstick
) -> TargetOutcome[Target]:
    if not yardstick.err_hidden or not yardstick.err_classifier:
        return TargetOutcome(target, "n/a (torch bf16 yardstick unavailable)")
    if ours.err_hidden is None or ours.err_classifier is None:
        return TargetOutcome(target, f"{FAIL} (no gradient)")
    ratio_hidden = ours.err_hidden / yardstick.err_hidden
    ratio_classifier = ours.err_classifier / yardstick.err_classifier
    ratio = max(ratio_hidden, ratio_classifier)
    text = (
        f"dE {ours.err_hidden:.1e} ({ratio_hidden:.2f}×), "
        f"dC {ours.err_classifier:.1e} ({ratio_classifier:.2f}×)"
    )
    return TargetOutcome(target, PASS if ratio <= target.factor else FAIL, text, ratio)


def evaluate_targets(case_results: Sequence[CaseResult]) -> list[TargetOutcome[Target]]:
    outcomes = []
    for case_result in case_results:
        for target in targets_for_case(case_result.case, list(case_result.results)):
            outcomes.append(evaluate_target(target, case_result))
    return outcomes


# ----------------------------------------------------------------------------- reports


@dataclass(kw_only=True)
class RunInfo(common.RunInfoBase):
    """Everything about a run that is not a per-case figure: the shared settings, then N."""

    n: int


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


def render_markdown(
    info: RunInfo, case_results: Sequence[CaseResult], outcomes: Sequence[TargetOutcome[Target]]
) -> str:
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
        ("N, dtype, seed", f"{info.n} tokens, {info.dtype}, seed {info.seed}"),
        common.matmul_row(info.matmul),
        (
            "timing",
            common.do_bench_text(info.timing)
            + ", ms; forward+backward = torch.autograd.grad(loss, (E, C))"
            if common.uses_cuda(env["device"])
            else common.WALL_CLOCK_TIMING,
        ),
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
        "Median ms / peak MB above inputs and gradient buffers, forward+backward unless marked.",
        "",
    ]
    rows = [
        [cr.case.label]
        + [common.time_and_memory_cell(cr.results.get(key), "") for key, _ in columns]
        for cr in case_results
    ]
    lines += [common.markdown_table(["case (V, D)"] + [lbl for _, lbl in columns], rows), ""]

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
        [
            cr.case.label,
            common.format_ms(cr.floors_ms["forward"]),
            common.format_ms(cr.floors_ms["backward_unskipped"]),
            common.format_ms(cr.floors_ms["forward_backward_unskipped"]),
            common.fastest_cell(cr.results.values()),
        ]
        for cr in case_results
    ]
    headers = ["case (V, D)", "fwd 2NVD/R", "bwd 6NVD/R", "fwd+bwd 8NVD/R", "fastest measured"]
    lines += [common.markdown_table(headers, rows), ""]

    lines += common.targets_section(
        outcomes, PASS + "/" + FAIL, "No fusedloss provider was selected, so no targets apply."
    )

    lines += ["## All figures", ""]
    rows = []
    for cr in case_results:
        for result in cr.results.values():
            rows.append(
                [
                    cr.case.key,
                    result.label,
                    result.status,
                    common.format_ms(result.ms),
                    common.format_ratio(result.times_floor),
                    common.format_mib(result.peak_extra_mib),
                    *common.loss_cells(result),
                    common.format_error(result.err_hidden),
                    common.format_error(result.err_classifier),
                    _ratio_cell(result),
                    _skipped_cell(result),
                    result.note,
                ]
            )
    headers = [
        "case",
        "provider",
        "status",
        "ms",
        "× floor",
        "MB",
        "loss",
        "|loss − ref|",
        "dE err",
        "dC err",
        "err ratio dE / dC",
        "tiles skipped",
        "note",
    ]
    lines += [common.markdown_table(headers, rows), ""]
    ref_rows = [
        [cr.case.key, f"{cr.reference_loss:.5f}"]
        for cr in case_results
        if cr.reference_loss is not None
    ]
    lines += [common.markdown_table(["case", "float64 reference loss"], ref_rows), ""]
    lines += common.closing_sections(info.calls, info.notes)
    return "\n".join(lines)


def _skipped_cell(result: ProviderResult) -> str:
    """The share of the backward's tiles that filtering skipped (fusedloss's Triton path)."""
    return "—" if result.tiles_skipped is None else f"{100 * result.tiles_skipped:.2f}%"


def results_json(
    info: RunInfo, case_results: Sequence[CaseResult], outcomes: Sequence[TargetOutcome[Target]]
) -> dict[str, Any]:
    return {
        "suite": NAME,
        "environment": info.environment,
        "settings": {
            "n": info.n,
            "dtype": info.dtype,
            "seed": info.seed,
            "quick": info.quick,
            "warmup_ms": info.timing.warmup_ms,
            "rep_ms": info.timing.rep_ms,
            "providers": info.providers,
        },
        "matmul": info.matmul,
        "peer_versions": info.peer_versions,
        "definitions": {
            "memory": MEMORY_DEFINITION,
            "gradient_error": ERROR_DEFINITION,
            "floors": "forward 2NVD/R, backward unskipped 6NVD/R, forward+backward 8NVD/R",
            "check": f"|loss − ref| ≤ {LOSS_TOLERANCE}·max(1, |ref|) and dE, dC relative "
            f"error ≤ {GRADIENT_ERROR_BOUND}; failing rows have status 'wrong'",
        },
        "cases": [
            {
                "case": cr.case.key,
                "shape": cr.case.shape.name,
                "vocab_size": cr.case.shape.vocab_size,
                "hidden_size": cr.case.shape.hidden_size,
                "n": cr.case.n,
                "regime": cr.case.regime,
                "mode": cr.case.mode,
                "floors_ms": cr.floors_ms,
                "reference_loss": cr.reference_loss,
                "torch_bf16_error": {
                    "dE": cr.yardstick.err_hidden,
                    "dC": cr.yardstick.err_classifier,
                    "note": cr.yardstick.note,
                },
                "results": [asdict(r) for r in cr.results.values()],
            }
            for cr in case_results
        ],
        "targets": [common.target_json(o, baselines=list(o.target.baselines)) for o in outcomes],
        "calls": info.calls,
        "notes": info.notes,
    }


def short_tables(
    case_results: Sequence[CaseResult], outcomes: Sequence[TargetOutcome[Target]]
) -> str:
    """The terminal summary: targets, then one line per case and provider."""
    parts = []
    if outcomes:
        rows = [
            [o.status, o.target.case_key, o.target.provider, o.target.description, o.measured]
            for o in outcomes
        ]
        parts += [
            "targets",
            common.text_table(["", "case", "provider", "target", "measured"], rows),
            "",
        ]
    rows = [
        [
            *common.summary_cells(cr.case.key, result),
            _ratio_cell(result),
            _skipped_cell(result),
            (PASS if result.status == OK else FAIL) if result.measured else "",
        ]
        for cr in case_results
        for result in cr.results.values()
    ]
    headers = [*common.SUMMARY_HEADERS, "err ratio dE/dC", "skipped", "check"]
    parts += [common.text_table(headers, rows)]
    return "\n".join(parts)


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    provider_keys = list(lm_head_providers())
    parser.add_argument(
        "--shapes",
        type=common.comma_list(list(LM_HEAD_SHAPES)),
        help=f"comma list of {', '.join(LM_HEAD_SHAPES)}",
    )
    parser.add_argument(
        "--regimes",
        type=common.comma_list([*REGIMES, TRAINED_REGIME]),
        help="comma list of peaked, flat, trained (default with --shapes/--modes: peaked); "
        "trained: the hidden states, head and targets of a small GPT trained on real text, "
        "made by `python -m benchmarks.trained_lm --out DIR` (see --trained-lm)",
    )
    parser.add_argument(
        "--trained-lm", default=None,
        help=f"the trained regime's directory or file (default ${TRAINED_LM_ENV})",
    )
    parser.add_argument(
        "--modes",
        type=common.comma_list(MODES),
        help="comma list of fwd+bwd, fwd (default with --shapes/--regimes: fwd+bwd)",
    )
    parser.add_argument(
        "--providers",
        type=common.comma_list(provider_keys),
        default=provider_keys,
        help=f"comma list of {', '.join(provider_keys)} (default: all)",
    )
    parser.add_argument(
        "--n",
        type=int,
        default=None,
        help=f"tokens N (default {DEFAULT_N}; {QUICK_N} with --quick)",
    )
    common.add_dtype_seed_arguments(parser)
    common.add_quick_device_timing_arguments(
        parser, "tiny shapes and short timing: a smoke test that also runs on CPU"
    )
    common.add_matmul_output_arguments(parser)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    device = common.pick_device(args.device)
    if not common.uses_cuda(device) and not args.quick:
        log("the lm-head suite needs a CUDA device at full size; use --quick for a CPU smoke run")
        return 2
    quick = bool(args.quick)
    n = args.n or (QUICK_N if quick else DEFAULT_N)
    dtype = common.parse_dtype(args.dtype)
    timing = common.timing_settings(args.warmup_ms, args.rep_ms, quick)
    notes: list[str] = [common.QUICK_NOTE] if quick else []
    if not common.uses_cuda(device) and any(p.startswith(FUSEDLOSS) for p in args.providers):
        notes.append(common.use_triton_interpreter())

    all_providers = lm_head_providers()
    providers = [all_providers[key] for key in args.providers]
    try:
        cases = select_cases(args.shapes, args.regimes, args.modes, n, quick, args.trained_lm)
    except FileNotFoundError as error:
        log(str(error))
        return 2
    environment = common.collect_environment(device)
    log(
        f"lm-head on {environment['device_name']}: torch {environment['torch']}, "
        f"triton {environment['triton']}, N={n}, {common.dtype_name(dtype)}"
    )
    matmul = common.probe_matmul(device, args.matmul_size, quick, timing, dtype, log)

    case_results = run_cases(
        cases,
        providers,
        device=device,
        dtype=dtype,
        seed=args.seed,
        timing=timing,
        tflops=matmul["tflops"],
        log=log,
        trained_lm=args.trained_lm,
    )
    outcomes = evaluate_targets(case_results)

    calls: dict[str, str] = {}
    for cr in case_results:
        for result in cr.results.values():
            if result.call:
                calls.setdefault(result.label, result.call)
            common.note_problem(notes, cr.case.key, result)
        if cr.yardstick.note:
            notes.append(f"{cr.case.key}: {cr.yardstick.note}")
    info = RunInfo(
        environment=environment,
        matmul=matmul,
        n=n,
        dtype=common.dtype_name(dtype),
        seed=args.seed,
        quick=quick,
        timing=timing,
        providers=list(args.providers),
        peer_versions={
            name: common.package_version(name) for name in ("cut-cross-entropy", "liger-kernel")
        },
        calls=calls,
        notes=notes,
    )
    common.report_results(
        args.out,
        RESULTS_PREFIX,
        args.tag,
        info,
        markdown=render_markdown(info, case_results, outcomes),
        payload=results_json(info, case_results, outcomes),
        tables=short_tables(case_results, outcomes),
        log=log,
    )
    return 0


SUITE = Suite(
    name=NAME,
    help="linear cross-entropy of an LM head (gemma2-2b, llama3-8b, phi3.5 shapes)",
    add_arguments=add_arguments,
    run=run,
)
