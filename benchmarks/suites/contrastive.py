"""Suite ``contrastive``: CLIP, NT-Xent and SigLIP losses, ours against PyTorch and inf-cl.

Per case (shape × regime) and provider: an untimed check against a reference (also the
warm-up), peak memory (:data:`MEMORY_DEFINITION`) and the median forward+backward time
(``do_bench``; calls over :data:`SLOW_MS` are timed one by one, see :class:`SlowTiming`).
A provider's exception or out-of-memory becomes its row's status; the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks import common
from benchmarks import inputs as pairs
from benchmarks import providers as prov
from benchmarks.common import FAILED, NOT_INSTALLED, OK, UNAVAILABLE, TimingSettings
from benchmarks.providers import CLIP, NT_XENT, SIGLIP, ContrastiveProvider, Unavailable
from benchmarks.suites import Suite

NAME = "contrastive"
FUSEDLOSS, FUSEDLOSS_COMPILE, TORCH, INF_CL = "fusedloss", "fusedloss-compile", "torch", "inf-cl"
PROVIDER_KEYS = (FUSEDLOSS, FUSEDLOSS_COMPILE, TORCH, INF_CL)
DEFAULT_PROVIDERS = (FUSEDLOSS, TORCH, INF_CL)  # fusedloss-compile on request

# CLIP's logit_scale comes with the regime (1/0.07 random, 100 trained).
SIGLIP_LOGIT_SCALE, SIGLIP_LOGIT_BIAS = 10.0, -10.0  # SigLIP's initialization
NT_XENT_TEMPERATURE = 0.5  # SimCLR's large-batch temperature

# Sanity bounds of the check (catch a broken provider; the errors themselves are reported).
LOSS_TOLERANCE = 1e-2  # |loss − reference| ≤ LOSS_TOLERANCE · max(1, |reference|)
GRADIENT_ERROR_BOUND = 5e-2  # relative L2 error of a feature gradient
SCALAR_ERROR_BOUND = 0.5  # d logit_scale / d bias: sums that cancel; bf16 reaches 0.1 there
# Reference: float64 gradients while rows²·c ≤ 2^40 (clip-16k, nt-xent-64k; not clip-64k),
# a float32 loss (TF32 products, exact for bf16/fp16) up to REFERENCE_LOSS_MAX_ROWS, none above.
REFERENCE_GRADS_MAX_WORK = 1 << 40
REFERENCE_LOSS_MAX_ROWS = 262_144
SLOW_MS, SLOW_REPS, SLOW_BUDGET_MS = 500.0, 3, 10_000.0  # see SlowTiming

MEMORY_DEFINITION = (
    "peak MB above inputs and gradient buffers = (torch.cuda.max_memory_allocated() during "
    "one forward+backward call − memory_allocated() just before it − the gradients' bytes) "
    "/ 2^20; allocator cache emptied and peak counter reset right before the call"
)
ERROR_DEFINITION = (
    "relative L2 error ‖g − g_ref‖₂ / ‖g_ref‖₂ of each gradient of the mean loss against a "
    "float64 reference of the same inputs, where rows²·c ≤ 2^40; 'err ratio' = that error ÷ "
    "the materialized PyTorch loss's (b×b logits in the input dtype)"
)


@dataclass(frozen=True)
class ContrastiveShape:
    name: str
    loss: str  # "clip" | "nt-xent" | "siglip"
    rows: int  # b, or 2B for NT-Xent
    width: int  # c
    regimes: tuple[str, ...]  # run by default
    providers: tuple[str, ...]  # those that run on it (when selected)


_OURS, _BOTH = (FUSEDLOSS, FUSEDLOSS_COMPILE), ("random", "trained")
SHAPES = {s.name: s for s in (
    ContrastiveShape("clip-16k", CLIP, 16_384, 512, _BOTH, PROVIDER_KEYS),
    ContrastiveShape("siglip-16k", SIGLIP, 16_384, 512, ("random",), (*_OURS, TORCH)),
    ContrastiveShape("nt-xent-64k", NT_XENT, 65_536, 256, _BOTH, (*_OURS, TORCH)),
    ContrastiveShape("clip-64k", CLIP, 65_536, 512, _BOTH, PROVIDER_KEYS),
    ContrastiveShape("clip-128k", CLIP, 131_072, 768, _BOTH, PROVIDER_KEYS),
    ContrastiveShape("clip-256k", CLIP, 262_144, 512, _BOTH, _OURS),
    ContrastiveShape("clip-1m", CLIP, 1_048_576, 512, ("random",), _OURS),
)}
QUICK_ROWS_DIVISOR, QUICK_WIDTH_DIVISOR = 256, 8  # --quick: clip-1m → 4096 × 64, runs on CPU


@dataclass(frozen=True)
class Case:
    shape: ContrastiveShape
    regime: str
    rows: int
    width: int

    @property
    def loss(self) -> str:
        return self.shape.loss

    @property
    def key(self) -> str:
        return f"{self.shape.name} {self.regime}"

    @property
    def label(self) -> str:
        size = f"2×{self.rows // 2}" if self.loss == NT_XENT else f"{self.rows}"
        return f"{self.loss} {size}×{self.width} {self.regime}"

    @property
    def logit_scale(self) -> float:
        if self.loss == CLIP:
            return pairs.pair_logit_scale(self.regime)
        return SIGLIP_LOGIT_SCALE if self.loss == SIGLIP else 1.0 / NT_XENT_TEMPERATURE

    @property
    def parameters_text(self) -> str:
        if self.loss == CLIP:
            return f"logit_scale {self.logit_scale:.4g}"
        if self.loss == SIGLIP:
            return f"logit_scale {SIGLIP_LOGIT_SCALE:g}, logit_bias {SIGLIP_LOGIT_BIAS:g}"
        return f"τ {NT_XENT_TEMPERATURE:g}"

    def floors_ms(self, tflops: float) -> dict[str, float]:
        """Cost floors (docs/design.md) at rate R: one pass 8·r²·c/R, with reuse 4·r²·c/R."""
        work, to_ms = float(self.rows) ** 2 * self.width, 1e3 / (tflops * 1e12)
        return {"one_pass": 8 * work * to_ms, "one_pass_reuse": 4 * work * to_ms}

    @property
    def reference_grads(self) -> bool:
        return self.rows**2 * self.width <= REFERENCE_GRADS_MAX_WORK

    @property
    def reference_loss(self) -> bool:
        return self.rows <= REFERENCE_LOSS_MAX_ROWS


def select_cases(shapes: Sequence[str] | None, regimes: Sequence[str] | None,
                 quick: bool) -> list[Case]:
    """Every chosen shape (default: all) × the chosen regimes (default: the shape's own)."""
    cases = []
    for shape in (SHAPES[name] for name in shapes or SHAPES):
        rows, width = shape.rows, shape.width
        if quick:
            rows = max(16, rows // QUICK_ROWS_DIVISOR)
            rows, width = rows - rows % 2, max(16, width // QUICK_WIDTH_DIVISOR)
        cases += [Case(shape, regime, rows, width) for regime in regimes or shape.regimes]
    return cases


@dataclass
class CaseInputs:
    args: tuple[Any, ...]  # what the loss functions are called with
    leaves: tuple[Tensor, ...]  # what gradients are taken of
    grad_names: tuple[str, ...]


def make_case_inputs(case: Case, *, dtype: torch.dtype, device: torch.device,
                     seed: int) -> CaseInputs:
    """Features of the case's regime (requiring grad) and its tensor scale / bias."""
    if case.loss == NT_XENT:
        views = pairs.make_pair_features(
            case.rows // 2, case.width, case.regime, dtype=dtype, device=device, seed=seed
        )
        features = torch.cat(views).requires_grad_(True)
        del views
        return CaseInputs((features, NT_XENT_TEMPERATURE), (features,), ("dZ",))
    image, text = pairs.make_pair_features(
        case.rows, case.width, case.regime, dtype=dtype, device=device, seed=seed
    )
    scalars = [case.logit_scale] + ([SIGLIP_LOGIT_BIAS] if case.loss == SIGLIP else [])
    args = (image.requires_grad_(True), text.requires_grad_(True), *(
        torch.tensor(v, dtype=torch.float32, device=device, requires_grad=True) for v in scalars
    ))
    return CaseInputs(args, args, ("dI", "dT", "ds", "db")[: len(args)])


@dataclass
class Reference:
    loss: float
    dtype: str  # "float64" or "float32 (TF32 products)"
    directions: tuple[float, float] | None = None  # CLIP: image→text, text→image
    grads: dict[str, Tensor] | None = None


def _as_float(value: Tensor | float) -> float:
    return float(value.detach()) if isinstance(value, Tensor) else float(value)


@contextlib.contextmanager
def _tf32_products() -> Iterator[None]:
    """TF32 float32 matmuls: exact products of bf16/fp16 values (≤ 10 mantissa bits)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def contrastive_reference(loss: str, args: Sequence[Any], *, with_grads: bool,
                          dtype: torch.dtype = torch.float64, rows_per_chunk: int = 0
                          ) -> Reference:
    """The mean loss (and gradients) of ``args`` in ``dtype``, ``rows_per_chunk`` rows at a time
    (default: ≤ 256 MiB of logits, ≤ 4096 rows). ``args`` as the providers take them: CLIP
    (image, text, scale), NT-Xent (features, τ), SigLIP (image, text, scale, bias). Pass 1: the
    row (CLIP: and column) log-sum-exps, or SigLIP's softplus sums; pass 2 rebuilds each block
    of X = s·A Bᵀ (+ bias), forms G = ∂loss/∂X and accumulates dA = s·G B, dB = s·Gᵀ A,
    ds = Σ G ⊙ A Bᵀ, db = Σ G (NT-Xent: dZ = dA + dB)."""
    a = args[0].detach().to(dtype)
    b = a if loss == NT_XENT else args[1].detach().to(dtype)
    scale = 1.0 / _as_float(args[1]) if loss == NT_XENT else _as_float(args[2])
    bias = _as_float(args[3]) if loss == SIGLIP else 0.0
    n, m, device = a.shape[0], b.shape[0], a.device
    if rows_per_chunk <= 0:
        rows_per_chunk = max(1, min(4096, (256 << 20) // (a.element_size() * m)))
    half = n // 2
    tf32 = dtype == torch.float32 and args[0].dtype in (torch.bfloat16, torch.float16)

    def targets(start: int, stop: int) -> Tensor:
        rows = torch.arange(start, stop, device=device)
        return (rows + half) % n if loss == NT_XENT else rows

    def block_logits(start: int, stop: int) -> Tensor:
        x = (a[start:stop] @ b.T).mul_(scale)
        if bias:
            x.add_(bias)
        if loss == NT_XENT:
            local = torch.arange(stop - start, device=device)
            x[local, local + start] = -math.inf
        return x

    row_lse = torch.empty(n, dtype=dtype, device=device)
    target_logit = torch.empty(n, dtype=dtype, device=device)
    col_lse = torch.full((m,), -math.inf, dtype=dtype, device=device)
    sigmoid_total = torch.zeros((), dtype=dtype, device=device)
    if with_grads:
        grad_a, grad_b = torch.empty_like(a), torch.zeros_like(b)
        grad_scale, grad_bias = (torch.zeros((), dtype=dtype, device=device) for _ in range(2))

    def accumulate(start: int, stop: int, g: Tensor) -> None:
        g_b = g @ b
        grad_scale.add_((g_b * a[start:stop]).sum())  # Σ G ⊙ A Bᵀ
        grad_a[start:stop] = g_b.mul_(scale)
        grad_b.addmm_(g.T, a[start:stop], alpha=scale)

    with _tf32_products() if tf32 else contextlib.nullcontext():
        for start in range(0, n, rows_per_chunk):
            stop = min(n, start + rows_per_chunk)
            local = torch.arange(stop - start, device=device)
            x = block_logits(start, stop)
            if loss == SIGLIP:  # z = +1 on the diagonal, −1 elsewhere
                diagonal = x[local, local + start]
                sigmoid_total += (
                    F.softplus(x).sum() - F.softplus(diagonal).sum() + F.softplus(-diagonal).sum()
                )
                if with_grads:
                    g = torch.sigmoid(x).div_(n)
                    g[local, local + start] = -torch.sigmoid(-diagonal) / n
                    grad_bias += g.sum()
                    accumulate(start, stop, g)
                continue
            row_lse[start:stop] = torch.logsumexp(x, dim=1)
            target_logit[start:stop] = x[local, targets(start, stop)]
            if loss == CLIP:
                col_lse = torch.logaddexp(col_lse, torch.logsumexp(x, dim=0))
            del x
        if with_grads and loss != SIGLIP:
            for start in range(0, n, rows_per_chunk):
                stop = min(n, start + rows_per_chunk)
                local = torch.arange(stop - start, device=device)
                x = block_logits(start, stop)
                if loss == CLIP:
                    g = (x - row_lse[start:stop, None]).exp_().mul_(0.5)
                    g.add_((x - col_lse[None, :]).exp_(), alpha=0.5)
                else:
                    g = x.sub_(row_lse[start:stop, None]).exp_()
                g[local, targets(start, stop)] -= 1.0
                g.div_(n)
                accumulate(start, stop, g)
                del x, g

    if loss == SIGLIP:
        value, directions = float(sigmoid_total) / n, None
    elif loss == CLIP:
        i2t = float((row_lse - target_logit).mean())
        t2i = float((col_lse - target_logit).mean())
        value, directions = (i2t + t2i) / 2, (i2t, t2i)
    else:
        value, directions = float((row_lse - target_logit).mean()), None
    grads = None
    if with_grads and loss == NT_XENT:
        grads = {"dZ": grad_a.add_(grad_b)}
    elif with_grads:
        grads = {"dI": grad_a, "dT": grad_b, "ds": grad_scale, "db": grad_bias}
        if loss != SIGLIP:
            del grads["db"]
    name = "float64" if dtype == torch.float64 else common.dtype_name(dtype)
    if tf32:
        name += " (TF32 products)"
    return Reference(value, name, directions, grads)


@dataclass
class SlowTiming:
    """Calls estimated at ≥ ``threshold_ms`` are timed ``clamp(budget_ms / estimate, 2,
    max_reps)`` times one by one (once if ``max_reps`` is 1)."""

    threshold_ms: float = SLOW_MS
    max_reps: int = SLOW_REPS
    budget_ms: float = SLOW_BUDGET_MS

    def reps(self, estimate_ms: float) -> int:
        wanted = int(self.budget_ms // max(estimate_ms, 1e-3))
        return max(1, min(self.max_reps, max(2, wanted)))


@dataclass
class ProviderResult(common.ProviderResultBase):
    timing: str = ""  # how ms was measured
    first_call_ms: float | None = None  # the check call (includes compilation)
    peak_extra_mib: float | None = None
    loss: float | None = None
    loss_error: float | None = None  # |loss − reference|
    errors: dict[str, float] = field(default_factory=dict)  # gradient → relative L2 error
    ratios: dict[str, float] = field(default_factory=dict)  # error ÷ torch materialized's
    times_floor: float | None = None  # ms ÷ 8·r²·c/R


@dataclass
class CaseResult:
    case: Case
    floors_ms: dict[str, float]
    reference: Reference | None
    results: dict[str, ProviderResult] = field(default_factory=dict)
    note: str = ""


def run_provider(provider: ContrastiveProvider, case: Case, inputs: CaseInputs,
                 reference: Reference | None, *, timing: TimingSettings, slow: SlowTiming,
                 floor_ms: float | None) -> ProviderResult:
    """Check, measure memory, and time one provider on one case; never raises."""
    device = inputs.leaves[0].device
    result = ProviderResult(provider.key, provider.display_name())
    try:
        loss_fn = provider.build(device, case.loss)
    except Unavailable as error:
        peer_missing = provider.is_peer and "not importable" in str(error)
        result.status, result.note = (NOT_INSTALLED if peer_missing else UNAVAILABLE), str(error)
        return result
    except Exception as error:  # e.g. a process group that could not start
        result.status, result.note = FAILED, common.describe_error(error)
        return result
    result.call = provider.describe(case.loss)

    def forward_backward() -> tuple[Tensor, ...]:
        return torch.autograd.grad(loss_fn(*inputs.args), inputs.leaves)

    with common.failures_recorded(result, device):
        begin = time.perf_counter()
        _check(result, loss_fn, inputs, reference)
        common.synchronize(device)
        result.first_call_ms = estimate_ms = (time.perf_counter() - begin) * 1e3
        common.release_memory(device)
        if common.uses_cuda(device):
            begin = time.perf_counter()
            grad_bytes = sum(leaf.numel() * leaf.element_size() for leaf in inputs.leaves)
            result.peak_extra_mib = common.peak_extra_mib(forward_backward, device, grad_bytes)
            estimate_ms = (time.perf_counter() - begin) * 1e3
        if estimate_ms >= slow.threshold_ms:
            reps = slow.reps(estimate_ms)
            result.ms = common.median_ms_fixed(forward_backward, device, reps)
            result.timing = f"median of {reps} timed call{'s' if reps > 1 else ''}"
        else:
            result.ms = common.median_ms(forward_backward, device, timing)
            result.timing = "do_bench" if common.uses_cuda(device) else "wall-clock median"
        if floor_ms:
            result.times_floor = result.ms / floor_ms
    return result


def _check(result: ProviderResult, loss_fn: Callable[..., Tensor], inputs: CaseInputs,
           reference: Reference | None) -> None:
    """First (untimed) call: finite loss and gradients, compared with the reference."""
    loss = loss_fn(*inputs.args)
    grads = dict(zip(inputs.grad_names, torch.autograd.grad(loss, inputs.leaves), strict=True))
    result.loss = float(loss.detach().float())
    del loss
    problems = [] if math.isfinite(result.loss) else [f"loss {result.loss}"]
    problems += [f"{name} not finite" for name, g in grads.items() if not torch.isfinite(g).all()]
    if reference is not None:
        result.loss_error, loss_problems = common.check_loss(result.loss, reference.loss,
                                                             LOSS_TOLERANCE)
        problems += loss_problems
        for name, grad in grads.items() if reference.grads is not None else ():
            error = result.errors[name] = common.relative_l2_error(grad, reference.grads[name])
            bound = GRADIENT_ERROR_BOUND if grad.dim() else SCALAR_ERROR_BOUND
            if not error <= bound:  # also catches NaN
                problems.append(f"{name} relative error {error:.2e} > {bound}")
    del grads
    common.mark_wrong(result, problems)


def run_cases(cases: Sequence[Case], providers: Sequence[ContrastiveProvider], *,
              device: torch.device, dtype: torch.dtype, seed: int, timing: TimingSettings,
              slow: SlowTiming, tflops: float, log: Callable[[str], None] = print
              ) -> list[CaseResult]:
    """Run every provider of every case (the shape's providers among those selected)."""
    case_results: list[CaseResult] = []
    for case in cases:
        cr = CaseResult(case, case.floors_ms(tflops), None)
        case_results.append(cr)
        try:
            inputs = make_case_inputs(case, dtype=dtype, device=device, seed=seed)
        except Exception as error:  # e.g. out of memory for the inputs themselves
            cr.note = f"inputs could not be made: {common.describe_error(error)}"
            log(f"[{case.key}] {cr.note}")
            common.release_memory(device)
            continue
        cr.reference, cr.note = _reference(case, inputs)
        common.release_memory(device)
        log(f"[{case.key}] {case.label}, {case.parameters_text}: "
            + (f"reference loss {_loss_text(cr)}, {cr.reference.dtype}" if cr.reference
               else cr.note))
        for provider in providers:
            if provider.key not in case.shape.providers or not provider.supports(case.loss):
                continue
            result = cr.results[provider.key] = run_provider(
                provider, case, inputs, cr.reference, timing=timing, slow=slow,
                floor_ms=cr.floors_ms["one_pass"],
            )
            log(f"  {case.key:<22} {result.label:<20} "
                + common.progress_line(result, _figures_text))
        base = cr.results.get(TORCH)  # error ratios against torch materialized
        for result in cr.results.values():
            result.ratios.update({k: e / base.errors[k] for k, e in result.errors.items()
                                  if base is not None and base.errors.get(k)})
        del inputs
        common.release_memory(device)
    return case_results


def _reference(case: Case, inputs: CaseInputs) -> tuple[Reference | None, str]:
    if not case.reference_loss:
        return None, f"no reference above {REFERENCE_LOSS_MAX_ROWS} rows: loss only checked finite"
    grads = case.reference_grads
    try:
        dtype = torch.float64 if grads else torch.float32
        return contrastive_reference(case.loss, inputs.args, with_grads=grads, dtype=dtype), ""
    except Exception as error:  # an OOM here must not end the run
        return None, f"reference unavailable: {common.describe_error(error)}"


# ----------------------------------------------------------------------------- reports


@dataclass(kw_only=True)
class RunInfo(common.RunInfoBase):
    slow: SlowTiming
    backend: str


def _figures_text(result: ProviderResult) -> str:
    text = (f"{common.format_ms(result.ms)} ms ({result.timing}), "
            f"{common.format_mib(result.peak_extra_mib)} MB, loss {result.loss:.5g}")
    if result.times_floor is not None:
        text += f", {result.times_floor:.2f}× floor"
    return text + "".join(f", {k} {v:.1e}" for k, v in result.errors.items())


def _errors_text(result: ProviderResult | None) -> str:
    if result is None or not result.errors:
        return "—"
    return ", ".join(
        f"{name} {error:.1e}" + (f" ({r:.2g}×)" if (r := result.ratios.get(name)) is not None
                                 else "")
        for name, error in result.errors.items()
    )


def _loss_text(cr: CaseResult) -> str:
    """The reference loss (CLIP: and its two directions), else fusedloss's."""
    ref = cr.reference
    if ref is None:
        ours = cr.results.get(FUSEDLOSS)
        has_loss = ours is not None and ours.loss is not None
        return f"{ours.loss:.4f} (fusedloss; no reference)" if has_loss else "—"
    text = f"{ref.loss:.4f}"
    if ref.directions:
        text += f" (i→t {ref.directions[0]:.4f}, t→i {ref.directions[1]:.4f})"
    return text


Column = tuple[str, Callable[[Any], Any]]  # header, cell of one row item


def _provider_columns(case_results: Sequence[CaseResult], cell: Callable) -> list[Column]:
    return [(label, lambda cr, k=key: cell(cr.results.get(k)))
            for key, label in common.provider_columns(case_results)]


def render_markdown(info: RunInfo, case_results: Sequence[CaseResult]) -> str:
    env, slow = info.environment, info.slow
    lines = [f"# Contrastive losses: {env['device_name']}, {env['date']}", ""]
    if info.quick:
        lines += ["> **--quick run**: rows shrunk 256×, widths 8×, short timing. A smoke test "
                  "of the runner; the figures are not representative.", ""]
    timing = common.WALL_CLOCK_TIMING
    if common.uses_cuda(env["device"]):
        timing = (
            "forward+backward = torch.autograd.grad(loss, (features…, logit_scale…)); "
            f"{common.do_bench_text(info.timing)} for calls under {slow.threshold_ms:g} ms, "
            f"else the median of clamp({slow.budget_ms / 1e3:g} s / call, 2, {slow.max_reps}) "
            "calls each timed between CUDA events (the 'timing' column says which)"
        )
    inputs = (
        "bf16 features L2-normalized in fp32 and cast (benchmarks/inputs.py make_pair_features)."
        " random: independent random unit vectors, CLIP logit_scale 1/0.07. trained: b/"
        f"{pairs.TRAINED_CLUSTER_SIZE} clusters, random unit centres c_k, image_i = normalize("
        f"c_k + {pairs.TRAINED_LATENT:g}·w_i + {pairs.TRAINED_NOISE:g}·n_i), text_i the same "
        "with n'_i (random unit w, n, n'); CLIP "
        "logit_scale 100. NT-Xent: the image and text features of B pairs stacked (2B × c), "
        f"τ = {NT_XENT_TEMPERATURE:g}. SigLIP: logit_scale {SIGLIP_LOGIT_SCALE:g}, logit_bias "
        f"{SIGLIP_LOGIT_BIAS:g}"
    )
    settings = [
        *common.environment_rows(env, info.peer_versions, f", backend {info.backend}"),
        ("dtype, seed", f"{info.dtype}, seed {info.seed}"),
        common.matmul_row(info.matmul),
        ("timing", timing),
        ("memory", MEMORY_DEFINITION),
        ("gradient error", ERROR_DEFINITION),
        ("inputs", inputs),
        ("floor", "the one-pass cost floor (docs/design.md) 8·r²·c/R (r = b, or 2B for NT-Xent; "
                  "R measured above); 4·r²·c/R if the backward reuses forward statistics well"),
    ]
    lines += [common.markdown_table(["setting", "value"], settings), ""]

    def floor(header: str, name: str) -> Column:
        return header, lambda cr: common.format_ms(cr.floors_ms[name])
    label: Column = ("case (loss b×c regime)", lambda cr: cr.case.label)
    ours = ("fusedloss × floor", lambda cr: common.format_ratio(
        r.times_floor) if (r := cr.results.get(FUSEDLOSS)) else "—")
    lines += common.section(
        "Time and memory",
        "Median ms / peak MB above inputs and gradient buffers, forward+backward (— = not run "
        "on this shape); cost floors (docs/design.md) 8·r²·c/R, 4·r²·c/R with reuse.",
        [label, *_provider_columns(case_results, lambda r: common.time_and_memory_cell(r, "—")),
         ("fastest", lambda cr: common.fastest_cell(cr.results.values())),
         floor("floor 8r²c/R", "one_pass"), floor("4r²c/R", "one_pass_reuse"), ours],
        case_results,
    )
    accuracy = [cr for cr in case_results if any(r.errors for r in cr.results.values())]
    if accuracy:
        lines += common.section(
            "Gradient accuracy",
            "Relative L2 error against the float64 reference (÷ torch materialized's error in "
            "parentheses).",
            [label, *_provider_columns(case_results, _errors_text)], accuracy,
        )
    lines += common.section("Losses", "", [
        label, ("parameters", lambda cr: cr.case.parameters_text),
        ("mean loss (reference)", _loss_text),
        ("reference", lambda cr: cr.reference.dtype if cr.reference else "—"),
    ], case_results)
    rows = [(cr, r) for cr in case_results for r in cr.results.values()]
    lines += common.section("All figures", "", [
        ("case", lambda x: x[0].case.key), ("provider", lambda x: x[1].label),
        ("status", lambda x: x[1].status), ("ms", lambda x: common.format_ms(x[1].ms)),
        ("timing", lambda x: x[1].timing),
        ("× floor", lambda x: common.format_ratio(x[1].times_floor)),
        ("MB", lambda x: common.format_mib(x[1].peak_extra_mib)),
        ("loss", lambda x: common.loss_cells(x[1])[0]),
        ("|loss − ref|", lambda x: common.loss_cells(x[1])[1]),
        ("gradient errors", lambda x: _errors_text(x[1])),
        ("first call ms", lambda x: common.format_ms(x[1].first_call_ms)),
        ("note", lambda x: x[1].note),
    ], rows)
    return "\n".join(lines + common.closing_sections(info.calls, info.notes))


def results_json(info: RunInfo, case_results: Sequence[CaseResult]) -> dict[str, Any]:
    settings = dict(dtype=info.dtype, seed=info.seed, quick=info.quick,
                    warmup_ms=info.timing.warmup_ms, rep_ms=info.timing.rep_ms,
                    slow=asdict(info.slow), backend=info.backend, providers=info.providers)
    inputs = {
        "trained": dict(cluster_size=pairs.TRAINED_CLUSTER_SIZE, latent=pairs.TRAINED_LATENT,
                        noise=pairs.TRAINED_NOISE),
        "logit_scale": {regime: pairs.pair_logit_scale(regime) for regime in pairs.PAIR_REGIMES},
        "siglip": {"logit_scale": SIGLIP_LOGIT_SCALE, "logit_bias": SIGLIP_LOGIT_BIAS},
        "nt_xent_temperature": NT_XENT_TEMPERATURE,
    }
    definitions = {
        "memory": MEMORY_DEFINITION,
        "gradient_error": ERROR_DEFINITION,
        "floors": "one pass 8·r²·c/R; with reuse of forward statistics 4·r²·c/R",
        "check": f"|loss − ref| ≤ {LOSS_TOLERANCE}·max(1, |ref|), feature-gradient errors "
        f"≤ {GRADIENT_ERROR_BOUND}, scalar-gradient errors ≤ {SCALAR_ERROR_BOUND}, all "
        "finite; failing rows have status 'wrong'",
    }
    cases = [dict(
        case=cr.case.key, shape=cr.case.shape.name, loss=cr.case.loss, rows=cr.case.rows,
        width=cr.case.width, regime=cr.case.regime, parameters=cr.case.parameters_text,
        floors_ms=cr.floors_ms, reference=cr.reference and {
            k: getattr(cr.reference, k) for k in ("loss", "dtype", "directions")}, note=cr.note,
        results=[asdict(r) for r in cr.results.values()],
    ) for cr in case_results]
    return dict(suite=NAME, environment=info.environment, settings=settings,
                matmul=info.matmul, peer_versions=info.peer_versions, inputs=inputs,
                definitions=definitions, cases=cases, calls=info.calls, notes=info.notes)


def short_tables(case_results: Sequence[CaseResult]) -> str:
    """The terminal summary: mean losses, then one line per case and provider."""
    losses = [[cr.case.key, cr.case.parameters_text, _loss_text(cr)] for cr in case_results]
    rows = [
        [*common.summary_cells(cr.case.key, r), _errors_text(r),
         ("ok" if r.status == OK else "wrong") if r.measured else ""]
        for cr in case_results for r in cr.results.values()
    ]
    return "\n".join([
        "mean loss per case (reference)",
        common.text_table(["case", "parameters", "loss"], losses), "",
        common.text_table([*common.SUMMARY_HEADERS, "gradient errors", "check"], rows),
    ])


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", type=common.comma_list(list(SHAPES)),
                        help=f"comma list of {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--regimes", type=common.comma_list(pairs.PAIR_REGIMES),
                        help="comma list of random, trained (default: each shape's own; "
                        "clip-1m and siglip-16k run random only)")
    parser.add_argument("--providers", type=common.comma_list(PROVIDER_KEYS),
                        default=list(DEFAULT_PROVIDERS),
                        help=f"comma list of {', '.join(PROVIDER_KEYS)} (default: "
                        f"{','.join(DEFAULT_PROVIDERS)}); each shape runs those it supports")
    common.add_dtype_seed_arguments(parser)
    common.add_quick_device_timing_arguments(
        parser, "rows/256, widths/8 and short timing: a smoke test that also runs on CPU"
    )
    common.add_matmul_output_arguments(parser)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    device = common.pick_device(args.device)
    if not common.uses_cuda(device) and not args.quick:
        log("the contrastive suite needs a CUDA device at full size; use --quick on a CPU")
        return 2
    quick, dtype = bool(args.quick), common.parse_dtype(args.dtype)
    backend = "triton" if common.uses_cuda(device) else "torch"
    timing = common.timing_settings(args.warmup_ms, args.rep_ms, quick)
    slow = SlowTiming()
    table = prov.contrastive_providers(backend)
    providers = [table[key] for key in args.providers]
    cases = select_cases(args.shapes, args.regimes, quick)
    environment = common.collect_environment(device)
    log(f"contrastive on {environment['device_name']}: torch {environment['torch']}, "
        f"triton {environment['triton']}, {common.dtype_name(dtype)}, fusedloss backend "
        f"{backend}, cases: {', '.join(case.key for case in cases)}")
    matmul = common.probe_matmul(device, args.matmul_size, quick, timing, dtype, log)
    try:
        case_results = run_cases(cases, providers, device=device, dtype=dtype, seed=args.seed,
                                 timing=timing, slow=slow, tflops=matmul["tflops"], log=log)
    finally:
        prov.destroy_benchmark_process_group()

    notes = [common.QUICK_NOTE] if quick else []
    notes += [f"{p.display_name()}: {note}" for p in providers
              if (note := getattr(p, "process_group_note", ""))]
    calls: dict[str, str] = {}
    for cr in case_results:
        if cr.note:
            notes.append(f"{cr.case.key}: {cr.note}")
        for result in cr.results.values():
            if result.call:
                calls.setdefault(f"{result.label}, {cr.case.loss}", result.call)
            common.note_problem(notes, cr.case.key, result)
    info = RunInfo(environment=environment, matmul=matmul, dtype=common.dtype_name(dtype),
                   seed=args.seed, quick=quick, timing=timing, slow=slow, backend=backend,
                   providers=list(args.providers), calls=calls, notes=notes,
                   peer_versions={"inf-cl": common.package_version("inf-cl")})
    common.report_results(args.out, NAME, args.tag, info.environment, info.notes,
                          markdown=render_markdown(info, case_results),
                          payload=results_json(info, case_results),
                          tables=short_tables(case_results), log=log)
    return 0


SUITE = Suite(
    name=NAME,
    help="CLIP, NT-Xent and SigLIP losses against materialized PyTorch and inf-cl",
    add_arguments=add_arguments,
    run=run,
)
