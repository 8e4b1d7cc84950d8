"""Suite ``vocab-parallel``: the vocabulary-parallel LM head over K processes.

    torchrun --nproc_per_node=K benchmarks/run.py vocab-parallel [--tag T]   # gloo with --quick

Every rank builds the same (E, C, y) and keeps C's rows [⌊r·V/K⌋, ⌊(r+1)·V/K⌋). Providers
(forward+backward to (E, C_r)): ``fusedloss`` (process_group=WORLD), ``megatron`` (Megatron-LM's
``_VocabParallelCrossEntropy`` on materialized logits) and ``single-gpu`` (fusedloss on the full
C, rank 0 alone; its first call is the check's reference, with --quick also float64). Rank 0
writes ``vocab_parallel_<date>_<gpu-slug>_<K>gpu[_tag].md/.json``; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks import common
from benchmarks.inputs import LM_HEAD_SHAPES, LMHeadShape, make_lm_head_inputs, quick_shape
from benchmarks.suites import Suite
from benchmarks.suites.lm_head import (
    DEFAULT_N,
    GRADIENT_ERROR_BOUND,
    LOSS_TOLERANCE,
    reference_float64,
)
from benchmarks.suites.ring import (
    DEFAULT_MIN_REPS,
    Context,
    Ranks,
    RankTiming,
    collect_calls_notes,
    errors_text,
    per_rank_text,
    run_distributed,
    stage,
    time_on_all_ranks,
)

NAME = "vocab-parallel"
RESULTS_PREFIX = "vocab_parallel"
FUSEDLOSS, MEGATRON, SINGLE_GPU = "fusedloss", "megatron", "single-gpu"
PROVIDER_KEYS = (FUSEDLOSS, MEGATRON, SINGLE_GPU)
LABELS = {FUSEDLOSS: "fusedloss (sharded)", MEGATRON: "megatron-style (logits)",
          SINGLE_GPU: "fusedloss single GPU"}
DEFAULT_SHAPES = ("gemma2-2b", "llama3-8b")
REGIME = "peaked"
QUICK_N = 128

TIMING_DEFINITION = (
    "ms = max over the ranks of each rank's median time of one forward+backward step "
    "`torch.autograd.grad(loss(E, C_r, y), (E, C_r))`, timed as in the ring suite (the same "
    "number of calls on every rank). single-gpu: rank 0 alone with the full C while the other "
    "ranks wait at a barrier"
)
MEMORY_DEFINITION = (
    "peak MB per rank above inputs and gradient buffers: max_memory_allocated() during one "
    "step − memory_allocated() before it − (N·D + V_r·D) × element size (single-gpu: V for "
    "V_r); max over the ranks; NCCL's own buffers not counted"
)
CHECK_DEFINITION = (
    "first, untimed call: every rank's loss within "
    f"{LOSS_TOLERANCE}·max(1, |ref|) of the single-GPU head's loss (rank 0, broadcast); "
    "relative L2 errors of dE (max over the ranks) and dC (over the whole weight) against "
    f"its gradients, bound {GRADIENT_ERROR_BOUND}; with --quick the same against a float64 "
    "reference. Failing rows are 'wrong' and still timed"
)


@dataclass(frozen=True)
class Case:
    shape: LMHeadShape
    regime: str
    n: int
    world: int

    @property
    def key(self) -> str:
        return f"{self.shape.name} {self.regime}"

    @property
    def label(self) -> str:
        return (f"{self.shape.name} ({self.shape.vocab_size}, {self.shape.hidden_size}) "
                f"{self.regime}, N={self.n}, K={self.world}")

    def bounds(self, rank: int) -> tuple[int, int]:
        return shard_bounds(self.shape.vocab_size, self.world, rank)


def shard_bounds(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows [⌊r·V/K⌋, ⌊(r+1)·V/K⌋) of a V-row classifier over K ranks."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside [0, {world})")
    return rank * vocab // world, (rank + 1) * vocab // world


def select_cases(shapes: Sequence[str], n: int, world: int, quick: bool) -> list[Case]:
    """One case per shape (--quick: V/128, D/32); each rank needs ≥ 1 row."""
    cases = []
    for name in shapes:
        shape = quick_shape(LM_HEAD_SHAPES[name]) if quick else LM_HEAD_SHAPES[name]
        if shape.vocab_size < world:
            raise ValueError(f"{name}: V = {shape.vocab_size} rows cannot be shared by "
                             f"{world} ranks")
        cases.append(Case(shape, REGIME, n, world))
    return cases


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's ``_CopyToModelParallelRegion``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron-LM's ``_VocabParallelCrossEntropy`` (no label smoothing) on this rank's float32
    logits (N, V_r), in place as Megatron does; saves the shard's softmax."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start, group):
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)

        partition_vocab_size = vocab_parallel_logits.size(-1)
        target_mask = (target < vocab_start) | (target >= vocab_start + partition_vocab_size)
        masked_target = target.clone() - vocab_start
        masked_target[target_mask] = 0

        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(logits_2d.size(0), device=logits_2d.device)
        predicted_logits = logits_2d[arange_1d, masked_target_1d].clone().contiguous()
        predicted_logits = predicted_logits.view_as(target)
        predicted_logits[target_mask] = 0.0
        dist.all_reduce(predicted_logits, group=group)

        exp_logits = vocab_parallel_logits
        torch.exp(vocab_parallel_logits, out=exp_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp_logits, group=group)

        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d = grad_input.view(-1, grad_input.size(-1))
        arange_1d = torch.arange(grad_2d.size(0), device=grad_2d.device)
        grad_2d[arange_1d, masked_target_1d] -= 1.0 - target_mask.view(-1).float()
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None, None, None


def megatron_loss(hidden: Tensor, classifier_shard: Tensor, target: Tensor, vocab_start: int,
                  group: dist.ProcessGroup | None = None) -> Tensor:
    """The Megatron-style vocabulary-parallel head: mean cross-entropy over the tokens."""
    group = group or dist.group.WORLD
    hidden = CopyToTensorParallelRegion.apply(hidden, group)
    logits = torch.matmul(hidden, classifier_shard.t()).float()
    return VocabParallelCrossEntropy.apply(logits, target, vocab_start, group).mean()


@dataclass
class RankInputs:
    hidden: Tensor  # E (N, D), leaf
    shard: Tensor  # C_r (V_r, D), leaf
    target: Tensor  # y (N,)
    start: int
    full: Tensor | None  # C (V, D): rank 0 only (the single-GPU head), a leaf

    def gradient_bytes(self, full: bool = False) -> int:
        rows = (self.full if full else self.shard).shape[0]
        return (self.hidden.numel() + rows * self.hidden.shape[1]) * self.hidden.element_size()


@dataclass
class CaseReference:
    """The single-GPU head's loss and this rank's parts of its gradients (dE, dC rows); the
    float64 ones with --quick."""

    loss: float | None = None
    grad_hidden: Tensor | None = None
    grad_shard: Tensor | None = None
    f64_loss: float | None = None
    f64_grad_hidden: Tensor | None = None
    f64_grad_shard: Tensor | None = None
    note: str = ""


@dataclass
class ProviderResult(common.ProviderResultBase):
    timing: str = ""
    reps: int | None = None
    ms_per_rank: list[float] = field(default_factory=list)
    first_call_ms: float | None = None
    peak_extra_mib: float | None = None
    peak_per_rank: list[float] = field(default_factory=list)
    loss: float | None = None
    rank_losses: list[float] = field(default_factory=list)
    loss_error: float | None = None  # max over the ranks, against the single-GPU loss
    f64_loss_error: float | None = None
    errors: dict[str, float] = field(default_factory=dict)  # dE, dC (vs single GPU; f64 …)
    times_floor: float | None = None


@dataclass
class CaseResult:
    case: Case
    reference: dict[str, Any] = field(default_factory=dict)
    results: dict[str, ProviderResult] = field(default_factory=dict)
    note: str = ""


def local_ranks(device: torch.device) -> Any:
    """A stand-in for :class:`Ranks` over rank 0 alone (the single-GPU head's timing)."""
    return SimpleNamespace(rank=0, world=1, gather=lambda v: [v], max=lambda v: v,
                           barrier=lambda: common.synchronize(device))


def build_loss(key: str, inputs: RankInputs, backend: str) -> tuple[Callable[[], Tensor], str]:
    """This rank's loss of provider ``key`` and the call as the report states it."""
    import fusedloss

    E, y = inputs.hidden, inputs.target
    if key == FUSEDLOSS:
        return (lambda: fusedloss.linear_cross_entropy(
            E, inputs.shard, y, process_group=dist.group.WORLD, backend=backend),
            f'fusedloss.linear_cross_entropy(E, C_r, y, process_group=WORLD, backend="{backend}")')
    if key == MEGATRON:
        return (lambda: megatron_loss(E, inputs.shard, y, inputs.start),
                "VocabParallelCrossEntropy(copy_to_tp(E) @ C_rᵀ).float(), y).mean() (Megatron's "
                "_VocabParallelCrossEntropy; dE all-reduced by the copy-to-TP backward)")
    if key == SINGLE_GPU:
        assert inputs.full is not None
        return (lambda: fusedloss.linear_cross_entropy(E, inputs.full, y, backend=backend),
                f'fusedloss.linear_cross_entropy(E, C, y, backend="{backend}") on rank 0, the '
                "full C")
    raise ValueError(f"unknown provider {key!r}")


def check_sharded(result: ProviderResult, ranks: Ranks, loss: Tensor,
                  grads: Sequence[Tensor], ref: CaseReference) -> None:
    """A sharded provider's first call against the single-GPU head (and float64). Collective."""
    problems: list[str] = []
    result.rank_losses = ranks.gather(float(loss.detach().float()))
    result.loss = result.rank_losses[0]
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    if ranks.min(1.0 if finite else 0.0) < 1.0:
        problems.append("gradients not finite (on some rank)")
    for name, ref_loss, attr in (("single GPU", ref.loss, "loss_error"),
                                 ("float64", ref.f64_loss, "f64_loss_error")):
        if ref_loss is not None:
            errors = [common.check_loss(v, ref_loss, LOSS_TOLERANCE) for v in result.rank_losses]
            setattr(result, attr, max(e for e, _ in errors))
            problems += [f"{p} ({name})" for _, ps in errors for p in ps][:1]
    for suffix, ref_hidden, ref_shard in (("", ref.grad_hidden, ref.grad_shard),
                                          (" f64", ref.f64_grad_hidden, ref.f64_grad_shard)):
        if ref_hidden is None or ref_shard is None:
            continue
        de = ranks.max(common.relative_l2_error(grads[0], ref_hidden))
        dc = ranks.relative_error(grads[1], ref_shard)
        result.errors[f"dE{suffix}"], result.errors[f"dC{suffix}"] = de, dc
        for name, err in ((f"dE{suffix}", de), (f"dC{suffix}", dc)):
            if not err <= GRADIENT_ERROR_BOUND:
                problems.append(f"{name} relative error {err:.2e} > {GRADIENT_ERROR_BOUND}")
    common.mark_wrong(result, problems)


def memory_and_time(result: ProviderResult, ctx: Context, forward_backward: Callable[[], Any],
                    gradient_bytes: int, alone: bool) -> None:
    """Peak memory (CUDA) and time of ``forward_backward`` on every rank, or on rank 0 alone
    (the others wait; its figures shared). A collective; failures land in ``result``."""
    ranks, device = ctx.ranks, ctx.device
    run_here = not alone or ranks.rank == 0

    def on(action: Callable[[], Any]) -> Callable[[], Any]:
        return action if run_here else (lambda: None)

    if common.uses_cuda(device):
        ok, peak = stage(ranks, result, device, on(lambda: common.peak_extra_mib(
            forward_backward, device, gradient_bytes)))
        if not ok:
            return
        result.peak_per_rank = [ranks.objects(peak)[0]] if alone else ranks.gather(peak)
        result.peak_extra_mib = max(result.peak_per_rank)
    ok, timed = stage(ranks, result, device, on(lambda: time_on_all_ranks(
        forward_backward, device, local_ranks(device) if alone else ranks, ctx.timing,
        ctx.min_reps)))
    if ok:
        timed: RankTiming = ranks.objects(timed)[0] if alone else timed
        result.ms_per_rank, result.ms, result.reps = timed.per_rank_ms, timed.ms, timed.reps
        how = "CUDA events" if common.uses_cuda(device) else "wall clock"
        over = "rank 0 alone" if alone else "max over ranks"
        result.timing = f"median of {timed.reps} calls ({how}), {over}"
        common.release_memory(device)


def run_sharded(key: str, case: Case, inputs: RankInputs, reference: CaseReference,
                ctx: Context) -> ProviderResult:
    """Check, peak memory and time of a sharded provider on every rank; never raises."""
    ranks, device = ctx.ranks, ctx.device
    result = ProviderResult(key, LABELS[key])
    leaves = (inputs.hidden, inputs.shard)
    ok, built = stage(ranks, result, device, lambda: build_loss(key, inputs, ctx.backend))
    if not ok:
        return result
    loss_fn, result.call = built

    def forward_backward() -> tuple[Tensor, ...]:
        return torch.autograd.grad(loss_fn(), leaves)

    common.release_memory(device)
    common.synchronize(device)
    begin = time.perf_counter()
    ok, loss = stage(ranks, result, device, loss_fn)
    if not ok:
        return result
    ok, grads = stage(ranks, result, device, lambda: torch.autograd.grad(loss, leaves))
    if not ok:
        return result
    common.synchronize(device)
    result.first_call_ms = ranks.max((time.perf_counter() - begin) * 1e3)
    check_sharded(result, ranks, loss, grads, reference)
    loss = grads = None
    common.release_memory(device)
    memory_and_time(result, ctx, forward_backward, inputs.gradient_bytes(), alone=False)
    return result


def share_single_gpu_reference(ranks: Ranks, case: Case, device: torch.device, dtype: torch.dtype,
                               loss: float | None, grads: tuple[Tensor, Tensor] | None
                               ) -> CaseReference:
    """Rank 0's loss and dE broadcast; rank r gets its rows of dC. A collective."""
    reference = CaseReference(loss=ranks.objects(loss)[0])
    d = case.shape.hidden_size
    if ranks.rank == 0:
        grad_hidden = grads[0]
    else:
        grad_hidden = torch.empty(case.n, d, dtype=dtype, device=device)
    if ranks.world > 1:
        dist.broadcast(grad_hidden, src=0)
    reference.grad_hidden = grad_hidden
    for r in range(ranks.world):
        start, stop = case.bounds(r)
        if ranks.rank == 0:
            part = grads[1][start:stop].contiguous()
        else:
            part = torch.empty(stop - start, d, dtype=dtype, device=device)
        if r > 0:
            dist.broadcast(part, src=0)
        if r == ranks.rank:
            reference.grad_shard = part
        del part
    return reference


def run_single_gpu(case: Case, inputs: RankInputs, ctx: Context,
                   f64: Any = None) -> tuple[ProviderResult, CaseReference]:
    """The single-GPU head on rank 0 (the others wait): its first call is the case's reference
    (shared with every rank), then its memory and time."""
    ranks, device = ctx.ranks, ctx.device
    result = ProviderResult(SINGLE_GPU, LABELS[SINGLE_GPU])
    root = ranks.rank == 0

    def on_root(action: Callable[[], Any], default: Any = None) -> Callable[[], Any]:
        return action if root else (lambda: default)

    ok, built = stage(ranks, result, device,
                      on_root(lambda: build_loss(SINGLE_GPU, inputs, ctx.backend), (None, "")))
    if not ok:
        return result, CaseReference(note=f"no single-GPU reference: {result.note}")
    loss_fn = built[0]
    result.call = ranks.objects(built[1])[0]
    leaves = (inputs.hidden, inputs.full)

    def first_call() -> tuple[float, tuple[Tensor, ...]]:
        common.synchronize(device)
        begin = time.perf_counter()
        loss = loss_fn()
        grads = torch.autograd.grad(loss, leaves)
        common.synchronize(device)
        result.first_call_ms = (time.perf_counter() - begin) * 1e3
        return float(loss.detach().float()), tuple(g.detach() for g in grads)

    ok, first = stage(ranks, result, device, on_root(first_call))
    if not ok:
        return result, CaseReference(note=f"no single-GPU reference: {result.note}")
    loss, grads = first if root else (None, None)
    ok, reference = stage(ranks, result, device, lambda: share_single_gpu_reference(
        ranks, case, device, ctx.dtype, loss, grads))
    if not ok:
        return result, CaseReference(note=f"single-GPU reference not shared: {result.note}")
    result.loss = reference.loss
    if f64 is not None and result.loss is not None:
        result.f64_loss_error = abs(result.loss - f64.loss)
        if f64.grad_hidden is not None:
            errors = {"dE f64": common.relative_l2_error(grads[0], f64.grad_hidden),
                      "dC f64": common.relative_l2_error(grads[1], f64.grad_classifier)
                      } if root else {}
            result.errors = ranks.objects(errors)[0]
    if root and grads is not None and not all(bool(torch.isfinite(g).all()) for g in grads):
        result.note = "gradients not finite"
    grads = first = None
    common.release_memory(device)
    memory_and_time(result, ctx, lambda: torch.autograd.grad(loss_fn(), leaves),
                    inputs.gradient_bytes(full=True) if root else 0, alone=True)
    return result, reference


def run_case(case: Case, ctx: Context) -> CaseResult:
    ranks, device = ctx.ranks, ctx.device
    case_result, made = CaseResult(case), ProviderResult("inputs", "inputs")

    def make() -> tuple[RankInputs, Any]:
        hidden, classifier, target = make_lm_head_inputs(
            case.n, case.shape.vocab_size, case.shape.hidden_size, case.regime,
            dtype=ctx.dtype, device=device, seed=ctx.seed)
        start, stop = case.bounds(ranks.rank)
        inputs = RankInputs(
            hidden.clone().requires_grad_(True),
            classifier[start:stop].clone().requires_grad_(True), target, start,
            classifier.clone().requires_grad_(True) if ranks.rank == 0 else None)
        return inputs, (reference_float64(hidden, classifier, target, with_grads=True)
                        if ctx.quick else None)

    ok, value = stage(ranks, made, device, make)
    if not ok:
        case_result.note = f"inputs could not be made: {made.status}: {made.note}"
        ctx.say(f"[{case.key}] {case_result.note}")
        return case_result
    inputs, f64 = value
    del value
    single, reference = run_single_gpu(case, inputs, ctx, f64=f64)
    if f64 is not None:
        reference.f64_loss = f64.loss
        if f64.grad_hidden is not None:
            start, stop = case.bounds(ranks.rank)
            reference.f64_grad_hidden = f64.grad_hidden
            reference.f64_grad_shard = f64.grad_classifier[start:stop]
        del f64
    inputs.full = None  # the single-GPU runs are done: rank 0 frees the full C
    common.release_memory(device)
    case_result.reference = {"single_gpu_loss": reference.loss, "float64_loss": reference.f64_loss,
                             "gradients": reference.grad_hidden is not None,
                             "note": reference.note}
    case_result.note = reference.note
    ref_text = "—" if reference.loss is None else f"{reference.loss:.5f}"
    ctx.say(f"[{case.key}] {case.label}: single-GPU loss {ref_text}"
            + ("" if reference.f64_loss is None else f", float64 {reference.f64_loss:.5f}"))
    for key in PROVIDER_KEYS:
        outcome = single if key == SINGLE_GPU else run_sharded(key, case, inputs, reference, ctx)
        case_result.results[key] = outcome
        ctx.say(f"  {case.key:<20} {outcome.label:<26} "
                f"{common.progress_line(outcome, _figures_text)}")
    del inputs, reference
    common.release_memory(device)
    return case_result


def _figures_text(result: ProviderResult) -> str:
    text = f"{common.format_ms(result.ms)} ms, {common.format_mib(result.peak_extra_mib)} MB"
    if result.loss is not None:
        text += f", loss {result.loss:.5g}"
    if result.errors:
        text += ", " + ", ".join(f"{k} {v:.1e}" for k, v in result.errors.items())
    return text


def _loss_check_text(result: ProviderResult) -> str:
    parts = [f"{value:.1e} ({name})" for value, name in (
        (result.loss_error, "single GPU"), (result.f64_loss_error, "float64")) if value is not None]
    return ", ".join(parts) or "—"


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


# (header, cell of (case, result)) of the "All figures" table
FIGURE_COLUMNS: list[tuple[str, Callable[[Case, ProviderResult], Any]]] = [
    ("case", lambda c, r: c.key), ("provider", lambda c, r: r.label),
    ("status", lambda c, r: r.status), ("ms", lambda c, r: common.format_ms(r.ms)),
    ("ms per rank", lambda c, r: per_rank_text(r.ms_per_rank, common.format_ms)),
    ("calls", lambda c, r: _fmt(r.reps, "d")),
    ("MB", lambda c, r: common.format_mib(r.peak_extra_mib)),
    ("MB per rank", lambda c, r: per_rank_text(r.peak_per_rank, common.format_mib)),
    ("× floor", lambda c, r: common.format_ratio(r.times_floor)),
    ("loss", lambda c, r: _fmt(r.loss, ".5f")), ("|loss − ref|", lambda c, r: _loss_check_text(r)),
    ("gradient errors", lambda c, r: errors_text(r)),
    ("first call ms", lambda c, r: common.format_ms(r.first_call_ms)),
    ("note", lambda c, r: r.note),
]


def render_markdown(s: dict[str, Any], case_results: Sequence[CaseResult]) -> str:
    """``s``: the JSON's settings, plus environment, matmul, calls and notes."""
    env, timing = s["environment"], s["timing"]
    lines = [f"# Vocabulary-parallel LM head over {s['world_size']} × {env['device_name']}, "
             f"{env['date']}", ""]
    if s["quick"]:
        lines += ["> **--quick run**: tiny shapes and short timing. A smoke test of the runner; "
                  "the figures are not representative.", ""]
    rows = [
        *common.environment_rows(env, {}, f", backend {s['backend']}"),
        ("ranks", f"K = {s['world_size']}, torch.distributed backend {s['dist_backend']}"),
        ("dtype, N, seed", f"{s['dtype']}, N = {s['n']}, seed {s['seed']}"),
        common.matmul_row(s["matmul"]),
        ("timing", f"{TIMING_DEFINITION}; warmup {timing.warmup_ms:g} ms, rep "
         f"{timing.rep_ms:g} ms, min_reps {s['min_reps']}"
         + ("" if common.uses_cuda(env["device"]) else "; " + common.WALL_CLOCK_TIMING)),
        ("memory", MEMORY_DEFINITION),
        ("check", CHECK_DEFINITION),
        ("inputs", "benchmarks/inputs.py make_lm_head_inputs(N, V, D, regime, seed) on every "
                   "rank; rank r keeps C's rows [⌊r·V/K⌋, ⌊(r+1)·V/K⌋)"),
        ("floor", "one rank's share of the cost floor (docs/design.md): 8·N·V·D / (K·R) "
                  "(single GPU: 8·N·V·D / R)"),
    ]
    columns = common.provider_columns(case_results)
    lines += [common.markdown_table(["setting", "value"], rows), "", "## Time and memory", "",
              "ms per forward+backward step (max over ranks of each rank's median) / peak MB "
              "per rank above inputs and gradient buffers (max over ranks); single GPU: rank 0 "
              "alone on the full weight.", "",
              common.markdown_table(["case"] + [label for _, label in columns], [
                  [cr.case.label] + [common.time_and_memory_cell(cr.results.get(key), "—")
                                     for key, _ in columns] for cr in case_results]), "",
              "## All figures", "",
              common.table([(h, lambda item, f=f: f(*item)) for h, f in FIGURE_COLUMNS],
                           [(cr.case, r) for cr in case_results for r in cr.results.values()]),
              ""]
    return "\n".join(lines + common.closing_sections(s["calls"], s["notes"]))


def short_tables(case_results: Sequence[CaseResult]) -> str:
    rows = [[*common.summary_cells(cr.case.key, r), _loss_check_text(r) if r.measured else "",
             errors_text(r) if r.measured else ""]
            for cr in case_results for r in cr.results.values()]
    return common.text_table([*common.SUMMARY_HEADERS, "|loss − ref|", "gradient errors"], rows)


def _report(args: argparse.Namespace, ctx: Context, matmul: dict[str, Any], n: int,
            case_results: Sequence[CaseResult]) -> None:
    world, env = ctx.ranks.world, ctx.environment
    calls, notes = collect_calls_notes(case_results, ctx.notes)
    for cr in case_results:
        full_floor = 8.0 * n * cr.case.shape.vocab_size * cr.case.shape.hidden_size \
            / (matmul["tflops"] * 1e12) * 1e3
        for r in cr.results.values():
            floor = full_floor if r.provider == SINGLE_GPU else full_floor / world
            r.times_floor = r.ms / floor if r.measured else None
    settings = {
        "world_size": world, "dist_backend": ctx.dist_backend,
        "dtype": common.dtype_name(ctx.dtype), "n": n, "shapes": list(args.shapes),
        "regimes": [REGIME], "seed": ctx.seed, "quick": ctx.quick,
        "warmup_ms": ctx.timing.warmup_ms, "rep_ms": ctx.timing.rep_ms,
        "min_reps": ctx.min_reps, "backend": ctx.backend, "providers": list(PROVIDER_KEYS),
        "f64_reference": ctx.quick,
    }
    payload = {
        "suite": NAME, "environment": env, "settings": settings, "matmul": matmul,
        "definitions": {"timing": TIMING_DEFINITION, "memory": MEMORY_DEFINITION,
                        "check": CHECK_DEFINITION, "floor": "8·N·V·D / (K·R) per rank"},
        "cases": [{
            "case": cr.case.key, "shape": cr.case.shape.name,
            "vocab_size": cr.case.shape.vocab_size, "hidden_size": cr.case.shape.hidden_size,
            "regime": cr.case.regime, "n": cr.case.n, "world_size": cr.case.world,
            "shards": [cr.case.bounds(r) for r in range(cr.case.world)],
            "reference": cr.reference, "note": cr.note,
            "results": [asdict(r) for r in cr.results.values()],
        } for cr in case_results],
        "calls": calls, "notes": notes,
    }
    markdown = render_markdown({**settings, "environment": env, "matmul": matmul,
                                "timing": ctx.timing, "calls": calls, "notes": notes},
                               case_results)
    common.report_results(args.out, RESULTS_PREFIX, args.tag, env, notes, markdown=markdown,
                          payload=payload, tables=short_tables(case_results), world=world,
                          log=ctx.say)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shapes", type=common.comma_list(list(LM_HEAD_SHAPES)), default=list(DEFAULT_SHAPES),
        help=f"comma list of {', '.join(LM_HEAD_SHAPES)} (default {','.join(DEFAULT_SHAPES)})")
    common.add_dtype_seed_arguments(parser)
    common.add_quick_device_timing_arguments(
        parser, "shapes V/128, D/32, N = 128, short timing: a smoke test that also runs on CPU "
        "(gloo)")
    parser.add_argument("--min-reps", type=int, default=DEFAULT_MIN_REPS,
                        help=f"at least this many timed calls (default {DEFAULT_MIN_REPS})")
    common.add_matmul_output_arguments(parser)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    return run_distributed(args, NAME, _run, log)


def _run(args: argparse.Namespace, ctx: Context) -> int:
    ranks = ctx.ranks
    n = QUICK_N if ctx.quick else DEFAULT_N
    try:
        cases = select_cases(args.shapes, n, ranks.world, ctx.quick)
    except ValueError as error:
        ctx.say(str(error))
        return 2
    if ranks.rank == 0:
        ctx.say(f"vocab-parallel on {ranks.world} × {ctx.environment['device_name']} "
                f"({ctx.dist_backend}): {common.dtype_name(ctx.dtype)}, N = {n}, fusedloss "
                f"backend {ctx.backend}, cases: {', '.join(case.key for case in cases)}")
    matmul = ctx.probe_matmul(args.matmul_size)
    case_results = [run_case(case, ctx) for case in cases]
    try:
        if ranks.rank == 0:
            _report(args, ctx, matmul, n, case_results)
    finally:
        ranks.barrier()
    return 0


SUITE = Suite(
    name=NAME,
    help="the vocabulary-parallel LM head over K processes (torchrun): fusedloss's sharded "
    "head against a Megatron-style baseline and the single-GPU head",
    add_arguments=add_arguments,
    run=run,
)
