"""Suite ``ring``: CLIP over K processes, fusedloss's ring against inf-cl and open_clip.

    torchrun --nproc_per_node=K benchmarks/run.py ring [options]   # NCCL; gloo with --quick on CPU

Rank r holds rows r·B/K … (r+1)·B/K − 1 of one global batch B drawn from the seed. Per case and
provider: a checked first call, peak memory per rank, the step time, and for fusedloss the
overlap of its transfers with compute. ``Ranks``/``stage``/``run_distributed`` are shared by the
other torchrun suites. Only rank 0 writes ``ring_<date>_<gpu-slug>_<K>gpu[_tag].md/.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib
import math
import os
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks import common
from benchmarks.common import FAILED, NOT_INSTALLED, OUT_OF_MEMORY, UNAVAILABLE, WRONG
from benchmarks.inputs import make_pair_features, pair_logit_scale
from benchmarks.providers import Unavailable, inf_cl_head_dim, inf_clip_loss
from benchmarks.suites import Suite
from benchmarks.suites.contrastive import (
    GRADIENT_ERROR_BOUND,
    LOSS_TOLERANCE,
    MEMORY_DEFINITION,
    REFERENCE_GRADS_MAX_WORK,
    REFERENCE_LOSS_MAX_ROWS,
    SCALAR_ERROR_BOUND,
    Reference,
    contrastive_reference,
)

NAME = "ring"
FUSEDLOSS, INF_CL, OPEN_CLIP = "fusedloss", "inf-cl", "open-clip"
PROVIDER_KEYS = (FUSEDLOSS, INF_CL, OPEN_CLIP)

DEFAULT_BATCHES = (65_536, 131_072, 262_144, 524_288, 1_048_576)
DEFAULT_WIDTH = 512
QUICK_BATCHES = (256, 512)
QUICK_WIDTH = 64

# A timed function: clamp(rep_ms / estimate, min_reps, MAX_REPS) calls after
# min(warmup_ms / estimate, MAX_WARMUP) warm-up calls, the same numbers on every rank.
DEFAULT_MIN_REPS = 3
MAX_REPS = 1000
MAX_WARMUP = 100
HOST_REPS = 5  # synchronized calls whose host (issue) time is measured
GRAPH_WARMUP_CALLS = 2
GROUP_TIMEOUT_S = 1800.0  # torch.distributed's timeout of a collective
REGIME = "random"  # make_pair_features' regime of every case
_ms, _mib = common.format_ms, common.format_mib

# The report's definitions, short; benchmarks/README.md ("The ring suite") has the long form.
TIMING_DEFINITION = (
    "ms = max over the ranks of each rank's median time of one forward+backward step "
    "`torch.autograd.grad(loss(image_r, text_r, logit_scale), leaves)` on b_r = B/K pairs; every "
    "rank makes n = clamp(rep_ms / estimate, min_reps, 1000) calls after min(warmup_ms / "
    "estimate, 100) warm-up calls, starting after a barrier; CUDA events, no L2 flush"
)
OVERLAP_DEFINITION = (
    "fusedloss only: (a) the step, (b) compute only (every ring `Shift` replaced by a copy of "
    "what a recorded step received), (c) transfers only (the recorded shifts, no compute); "
    "overlap = (b + c − a) / min(b, c) in [0, 1], exposed = a − b; K = 1: (c) and overlap —"
)
GRAPH_DEFINITION = (
    "fusedloss only, --graph, CUDA: the step captured once in a torch.cuda.CUDAGraph and timed "
    "like (a) by replaying it; one replay's gradients must equal an eager call's bit for bit"
)
RING_MEMORY_DEFINITION = (
    MEMORY_DEFINITION + " Per rank on its b_r rows (gradient bytes: its dI, dT, d logit_scale); "
    "MB = max over the ranks; NCCL's own buffers are not counted."
)
CHECK_DEFINITION = (
    f"first, untimed call: the ranks' mean loss within {LOSS_TOLERANCE}·max(1, |ref|) of the "
    f"global batch's reference (float64 with gradients while B²·c ≤ 2^40, float32 loss while B ≤ "
    f"{REFERENCE_LOSS_MAX_ROWS}, else the peers against fusedloss); relative L2 gradient errors "
    f"of dI, dT ÷ K ≤ {GRADIENT_ERROR_BOUND}, of d logit_scale ≤ {SCALAR_ERROR_BOUND}; failing "
    "rows are 'wrong' and still timed"
)
INPUTS_DEFINITION = (
    "make_pair_features(B, c, random, seed) (bf16 unit vectors), rank r holding pairs r·B/K … "
    "(r+1)·B/K − 1 (the same batch for every K); logit_scale a learnable fp32 1/0.07"
)
FLOOR_DEFINITION = "8·b_r·B·c / R per rank (docs/design.md's one-pass floor)"


@dataclass(frozen=True)
class Case:
    """One global batch B of pairs of width c over K ranks."""

    batch: int  # B
    world: int  # K
    width: int  # c
    regime: str = REGIME

    @property
    def per_rank(self) -> int:
        return self.batch // self.world

    @property
    def key(self) -> str:
        return f"B={self.batch} {self.regime}"

    @property
    def label(self) -> str:
        return f"{self.batch}×{self.width} ({self.world}×{self.per_rank}) {self.regime}"

    @property
    def logit_scale(self) -> float:
        return pair_logit_scale(self.regime)

    def floor_ms(self, tflops: float) -> float:
        return 8.0 * self.per_rank * self.batch * self.width / (tflops * 1e12) * 1e3

    @property
    def reference_grads(self) -> bool:
        return self.batch**2 * self.width <= REFERENCE_GRADS_MAX_WORK

    @property
    def reference_loss(self) -> bool:
        return self.batch <= REFERENCE_LOSS_MAX_ROWS


def select_cases(batches: Sequence[int], width: int, world: int) -> list[Case]:
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    uneven = [b for b in batches if b < world or b % world]
    if uneven:
        raise ValueError(f"global batches {uneven} do not split evenly over {world} ranks "
                         "(each rank holds B / K pairs)")
    return [Case(batch, world, width) for batch in batches]


def overlap_fraction(ring_ms: float | None, compute_ms: float | None,
                     comm_ms: float | None) -> float | None:
    """(b + c − a) / min(b, c) clamped to [0, 1]; None where a figure is missing or not
    finite, or min(b, c) ≤ 0."""
    if any(v is None or not math.isfinite(v) for v in (ring_ms, compute_ms, comm_ms)):
        return None
    shorter = min(compute_ms, comm_ms)
    if shorter <= 0:
        return None
    return min(1.0, max(0.0, (compute_ms + comm_ms - ring_ms) / shorter))


def exposed_comm_ms(ring_ms: float | None, compute_ms: float | None) -> float | None:
    """a − b: the step's time beyond its compute."""
    return None if ring_ms is None or compute_ms is None else ring_ms - compute_ms


def positive_int_list(text: str) -> list[int]:
    """An argparse ``type``: ``65536,131_072`` → [65536, 131072] (each ≥ 1)."""
    try:
        values = [int(v.strip().replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from error
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


@dataclass
class Ranks:
    """This process's place in the default group. Every method is a collective (every rank
    calls it, in the same order); values travel as float64 on ``device``."""

    rank: int
    world: int
    device: torch.device

    def gather(self, value: float) -> list[float]:
        local = torch.tensor([value], dtype=torch.float64, device=self.device)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return [float(p) for p in torch.cat(parts).cpu()]

    def max(self, value: float) -> float:
        return max(self.gather(value))

    def min(self, value: float) -> float:
        return min(self.gather(value))

    def sum(self, value: float) -> float:
        return math.fsum(self.gather(value))

    def relative_error(self, actual: Tensor, reference: Tensor) -> float:
        """(Σ_r ‖a_r − ref_r‖² / Σ_r ‖ref_r‖²)^½ of a tensor split over the ranks."""
        a, r = actual.double(), reference.double()
        diff, norm = self.sum(float(((a - r) ** 2).sum())), self.sum(float((r**2).sum()))
        return math.sqrt(diff / norm) if norm > 0 else (0.0 if diff == 0 else math.inf)

    def objects(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        """All ranks here, with their device work done."""
        self.gather(0.0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


Error = tuple[str, str]  # (status, note)


def agree(ranks: Ranks, result: Any, error: Error | None) -> bool:
    """Whether no rank failed; otherwise ``result`` takes the failure (an out-of-memory on any
    rank first, else the first failing rank's), on every rank."""
    errors = ranks.objects(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return True
    rank, (status, note) = next(((r, e) for r, e in failed if e[0] == OUT_OF_MEMORY), failed[0])
    result.status = status
    if ranks.world > 1 and not (len(failed) == ranks.world and len(set(errors)) == 1):
        others = [r for r, _ in failed if r != rank]
        note = f"rank {rank}: {note}" + (f" (also ranks {others})" if others else "")
    result.note = note
    return False


def stage(ranks: Ranks, result: Any, device: torch.device,
          action: Callable[[], Any]) -> tuple[bool, Any]:
    """Runs ``action`` on every rank: (True, its value) where every rank succeeded, else
    (False, None) with the failure in ``result`` on every rank."""
    value, error = None, None
    try:
        value = action()
    except Exception as exc:  # reported; the run goes on
        error = (OUT_OF_MEMORY if common.is_out_of_memory(exc) else FAILED,
                 common.describe_error(exc))
    if agree(ranks, result, error):
        return True, value
    del value
    common.release_memory(device)
    return False, None


@dataclass
class Context:
    """What a torchrun suite's body starts from (made by :func:`run_distributed`)."""

    ranks: Ranks
    device: torch.device
    dist_backend: str  # nccl or gloo
    backend: str  # fusedloss's: triton on CUDA, torch on the CPU
    dtype: torch.dtype
    seed: int
    quick: bool
    timing: common.TimingSettings
    min_reps: int
    notes: list[str]
    environment: dict[str, Any]  # rank 0's; {} on the others
    say: Callable[[str], None]  # rank 0's log; silent on the others

    def probe_matmul(self, size: int | None) -> dict[str, Any]:
        """Rank 0's matmul-rate probe; {} on the others."""
        if self.ranks.rank != 0:
            return {}
        return common.probe_matmul(self.device, size, self.quick, self.timing, self.dtype,
                                   self.say)


def make_context(args: argparse.Namespace, device: torch.device, dist_backend: str,
                 log: Callable[[str], None]) -> Context:
    rank, cuda = dist.get_rank(), common.uses_cuda(device)
    notes = [common.QUICK_NOTE] if args.quick else []
    if not cuda:
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)  # K processes share the cores; gloo crawls with more threads
        notes.append(f"CPU: {torch.get_num_threads()} thread(s) per rank")
    return Context(
        ranks=Ranks(rank, dist.get_world_size(),
                    device if dist_backend == "nccl" else torch.device("cpu")),
        device=device, dist_backend=dist_backend, backend="triton" if cuda else "torch",
        dtype=common.parse_dtype(args.dtype), seed=args.seed, quick=bool(args.quick),
        timing=common.timing_settings(args.warmup_ms, args.rep_ms, bool(args.quick)),
        min_reps=getattr(args, "min_reps", 1), notes=notes,
        environment=common.collect_environment(device) if rank == 0 else {},
        say=log if rank == 0 else (lambda _text: None),
    )


@dataclass
class RankTiming:
    per_rank_ms: list[float]  # each rank's median
    reps: int
    warmup: int
    # each rank's median host time to issue one call started on an idle GPU; [] if not measured
    per_rank_host_ms: list[float] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return max(self.per_rank_ms)


def time_on_all_ranks(fn: Callable[[], Any], device: torch.device, ranks: Ranks,
                      timing: common.TimingSettings, min_reps: int,
                      host: bool = False) -> RankTiming:
    """Each rank's median time of ``fn()`` over the same number of back-to-back calls on every
    rank; ``host``: then the host's time to issue one call started on an idle GPU (median of
    HOST_REPS; back to back it would include waits for the previous call's transfers)."""
    estimate = max(ranks.max(common.call_ms(fn, device)), 1e-3)
    warmup = min(MAX_WARMUP, int(timing.warmup_ms / estimate))
    reps = max(min_reps, min(MAX_REPS, int(timing.rep_ms / estimate)))
    for _ in range(warmup):
        fn()
    common.synchronize(device)
    ranks.barrier()
    if common.uses_cuda(device):
        events = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        samples = [float(start.elapsed_time(end)) for start, end in events]
    else:
        samples = [_wall_ms(fn) for _ in range(reps)]
    timed = RankTiming(ranks.gather(statistics.median(samples)), reps, warmup)
    if host:
        issue = []
        for _ in range(HOST_REPS):
            common.synchronize(device)
            ranks.barrier()
            issue.append(_wall_ms(fn))
        common.synchronize(device)
        timed.per_rank_host_ms = ranks.gather(statistics.median(issue))
    return timed


def _wall_ms(fn: Callable[[], Any]) -> float:
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e3


Specs = list[tuple[tuple[int, ...], torch.dtype]]


def _specs(tensors: Sequence[Tensor]) -> Specs:
    return [(tuple(t.shape), t.dtype) for t in tensors]


@dataclass
class RecordedShift:
    """One ``Shift`` of a recorded ring step."""

    tag: int
    send: Specs
    recv_specs: Specs
    recv: list[Tensor]  # the tensors as received (dropped by ShiftRecording.release)
    layout: Any  # the layout it went over


@dataclass
class ShiftRecording:
    """A ring step's shifts (forward and backward) in order, and its ``("post", i)`` /
    ``("wait", i)`` events."""

    shifts: list[RecordedShift] = field(default_factory=list)
    events: list[tuple[str, int]] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                   for shift in self.shifts for shape, dtype in shift.send)

    def release(self) -> None:
        for shift in self.shifts:
            shift.recv = []


def _ring_module() -> Any:
    from fusedloss.distributed import ring

    if not hasattr(ring, "Shift"):
        raise RuntimeError("fusedloss.distributed.ring has no Shift: the overlap measurement "
                           "needs updating")
    return ring


@contextlib.contextmanager
def ring_shift_replaced(replacement: type) -> Iterator[None]:
    """fusedloss's ring makes its transfers through ``replacement`` while this is active."""
    ring = _ring_module()
    original = ring.Shift
    ring.Shift = replacement
    try:
        yield
    finally:
        ring.Shift = original


def recording_shift(recording: ShiftRecording) -> type:
    """A ``Shift`` that makes the real transfer and records it in ``recording``."""
    real_shift = _ring_module().Shift

    class RecordingShift:
        def __init__(self, layout: Any, send: list[Tensor], recv: list[Tensor], tag: int = 0):
            self.index = len(recording.shifts)
            recording.shifts.append(
                RecordedShift(tag, _specs(send), _specs(recv), list(recv), layout))
            recording.events.append(("post", self.index))
            self._shift = real_shift(layout, send, recv, tag=tag)

        def wait(self) -> None:
            recording.events.append(("wait", self.index))
            self._shift.wait()

    return RecordingShift


class ComputeOnly:
    """Replays a recording without transfers: each ``Shift`` copies the recorded tensors into
    its receive buffers (the ring reads them through views); ``wait`` is free."""

    def __init__(self, recording: ShiftRecording):
        self.recording = recording
        self.cursor = 0

    def shift_class(self) -> type:
        replay = self

        class ReplayedShift:
            def __init__(self, layout: Any, send: list[Tensor], recv: list[Tensor],
                         tag: int = 0):
                shifts = replay.recording.shifts
                if replay.cursor >= len(shifts):
                    raise RuntimeError("the ring made more transfers than the recorded step")
                record = shifts[replay.cursor]
                replay.cursor += 1
                if _specs(recv) != record.recv_specs or record.tag != tag:
                    raise RuntimeError("the ring's transfers differ from the recorded step's")
                for buffer, received in zip(recv, record.recv, strict=True):
                    if buffer.numel():
                        buffer.copy_(received)

            def wait(self) -> None:
                return None

        return ReplayedShift

    def wrap(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` (one ring step), checked to make exactly the recorded shifts."""

        def step() -> Any:
            self.cursor = 0
            out = fn()
            if self.cursor != len(self.recording.shifts):
                raise RuntimeError(f"the ring made {self.cursor} transfers, the recorded step "
                                   f"{len(self.recording.shifts)}")
            return out

        return step


def transfers_only(recording: ShiftRecording, device: torch.device) -> Callable[[], None]:
    """The recorded shifts alone, posted and waited for in the recorded order through the
    ring's own ``Shift``, from zero-filled send buffers into receive buffers kept from call to
    call (one per shape, dtype and tag: shifts in flight together have different tags)."""
    shift_class = _ring_module().Shift
    pools: tuple[dict[Any, Tensor], dict[Any, Tensor]] = ({}, {})

    def buffer(pool: dict[Any, Tensor], key: tuple[Any, ...]) -> Tensor:
        if key not in pool:
            pool[key] = torch.zeros(key[0], dtype=key[1], device=device)
        return pool[key]

    plan = [(shift.layout, [buffer(pools[0], spec) for spec in shift.send],
             [buffer(pools[1], (*spec, shift.tag + j)) for j, spec in enumerate(shift.recv_specs)],
             shift.tag) for shift in recording.shifts]
    events = list(recording.events)

    def run() -> None:
        posted: dict[int, Any] = {}
        for kind, index in events:
            if kind == "post":
                layout, send, recv, tag = plan[index]
                posted[index] = shift_class(layout, send, recv, tag=tag)
            else:
                posted.pop(index).wait()
        for shift in posted.values():
            shift.wait()

    return run


LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (image_r, text_r, logit_scale) -> loss


def _attribute(module: str, name: str, hint: str) -> Any:
    try:
        found = importlib.import_module(module)
    except ImportError as error:
        raise Unavailable(f"{module} not importable: {error} ({hint})") from error
    if not hasattr(found, name):
        raise Unavailable(f"{module} has no {name}")
    return getattr(found, name)


@dataclass(frozen=True)
class RingProvider:
    """One CLIP implementation over the group: ``build(ctx, case)`` returns ``loss(image_r,
    text_r, logit_scale)`` (whose mean over the ranks is the global loss) or raises
    :class:`Unavailable`."""

    key: str
    label: str
    distribution: str
    call: str  # the call measured, as reported
    build: Callable[[Context, Case], LossFn]
    is_peer: bool = True
    scale_grad_summed: bool = False  # d logit_scale comes already summed over the ranks
    # bytes/element → a lower bound of the device memory one step needs per rank (0: small)
    required_bytes: Callable[[Case, int], int] = lambda case, element: 0

    def display_name(self) -> str:
        version = common.package_version(self.distribution) if self.is_peer else None
        return f"{self.label} {version}" if version else self.label


def _fusedloss(backend: str) -> Callable[[Context, Case], LossFn]:
    def build(ctx: Context, case: Case) -> LossFn:
        clip_loss = _attribute("fusedloss.distributed", "clip_loss", "pip install -e .")
        return lambda image, text, scale: clip_loss(image, text, scale, backend=backend)

    return build


INF_CL_HINT = "pip install inf-cl==1.2.1 --no-deps"
OPEN_CLIP_HINT = "pip install open-clip-torch --no-deps"


def _inf_cl(ctx: Context, case: Case) -> LossFn:
    """inf-cl's ``cal_inf_loss`` once per direction (its README's CLIP example), labels
    ``arange(b_r)``; its ``GradientGather`` all-reduces d logit_scale."""
    function = _attribute("inf_cl", "cal_inf_loss", INF_CL_HINT)
    if ctx.device.type != "cuda":
        raise Unavailable("inf-cl's Triton kernels (inline PTX) need a CUDA device")
    inf_cl_head_dim(case.width)  # raises Unavailable for a width it cannot take
    return inf_clip_loss(function, scale_inside=True)


def _open_clip(ctx: Context, case: Case) -> LossFn:
    """open_clip's ClipLoss: all-gathers both feature matrices (with gradient) and forms the
    rank's b_r × B logits in both directions."""
    loss_class = _attribute("open_clip.loss", "ClipLoss", OPEN_CLIP_HINT)
    # torch ≥ 2.7 deprecates torch.distributed.nn.all_gather, which open_clip calls.
    warnings.filterwarnings("ignore", message=r".*all_gather is deprecated",
                            category=FutureWarning)
    loss = loss_class(local_loss=True, gather_with_grad=True, cache_labels=True,
                      rank=ctx.ranks.rank, world_size=ctx.ranks.world)
    return lambda image, text, scale: loss(image, text, scale)


def ring_providers(backend: str) -> dict[str, RingProvider]:
    providers = [
        RingProvider(FUSEDLOSS, "fusedloss", "fusedloss",
                     f'fusedloss.distributed.clip_loss(image_r, text_r, logit_scale, '
                     f'backend="{backend}")  (reduction "mean", filter_eps "auto")',
                     _fusedloss(backend), is_peer=False),
        RingProvider(INF_CL, "inf-cl", "inf-cl",
                     "((cal_inf_loss(image_r, text_r, labels, logit_scale, head_dim=h) + "
                     "cal_inf_loss(text_r, image_r, labels, logit_scale, head_dim=h)) / 2)"
                     ".mean(), labels = arange(b_r), h = 256 (c % 256 ≠ 0: 128, 64, …)",
                     _inf_cl, scale_grad_summed=True),
        RingProvider(OPEN_CLIP, "open_clip ClipLoss", "open-clip-torch",
                     "open_clip.loss.ClipLoss(local_loss=True, gather_with_grad=True, "
                     "cache_labels=True, rank=r, world_size=K)(image_r, text_r, logit_scale)",
                     _open_clip,
                     # the two b_r × B log-softmax outputs its backward keeps
                     required_bytes=lambda case, element: 2 * case.per_rank * case.batch * element),
    ]
    return {provider.key: provider for provider in providers}


Leaves = tuple[Tensor, Tensor, Tensor]  # this rank's (image_r, text_r) and logit_scale


def make_inputs(case: Case, rank: int, ctx: Context) -> tuple[Leaves, Reference | None, str]:
    """The rank's rows of the global batch (the same for every K), and the global batch's
    reference (with gradients where affordable) or why there is none."""
    image, text = make_pair_features(case.batch, case.width, case.regime, dtype=ctx.dtype,
                                     device=ctx.device, seed=ctx.seed)
    rows = slice(rank * case.per_rank, (rank + 1) * case.per_rank)
    inputs = (image[rows].clone().requires_grad_(True), text[rows].clone().requires_grad_(True),
              torch.tensor(case.logit_scale, dtype=torch.float32, device=ctx.device,
                           requires_grad=True))
    if not case.reference_loss:
        return inputs, None, (f"no reference above {REFERENCE_LOSS_MAX_ROWS} rows: the peers' "
                              "losses are compared with fusedloss's")
    dtype = torch.float64 if case.reference_grads else torch.float32
    try:
        return inputs, contrastive_reference("clip", (image, text, case.logit_scale),
                                             with_grads=case.reference_grads, dtype=dtype), ""
    except Exception as error:  # an out-of-memory here must not end the run
        return inputs, None, f"reference unavailable: {common.describe_error(error)}"


@dataclass
class ProviderResult(common.ProviderResultBase):
    """One provider on one case, as rank 0 reports it (figures agreed over the ranks); *_ms
    figures are the max over ranks, *_per_rank each rank's median."""

    timing: str = ""
    reps: int | None = None
    ms_per_rank: list[float] = field(default_factory=list)
    host_ms: float | None = None
    host_per_rank: list[float] = field(default_factory=list)
    first_call_ms: float | None = None
    peak_extra_mib: float | None = None
    peak_per_rank: list[float] = field(default_factory=list)
    loss: float | None = None  # mean over the ranks
    rank_losses: list[float] = field(default_factory=list)
    loss_error: float | None = None
    check: str = ""  # what the loss was compared with
    errors: dict[str, float] = field(default_factory=dict)
    times_floor: float | None = None
    # fusedloss: overlap (OVERLAP_DEFINITION)
    compute_ms: float | None = None
    compute_per_rank: list[float] = field(default_factory=list)
    comm_ms: float | None = None
    comm_per_rank: list[float] = field(default_factory=list)
    exposed_comm_ms: float | None = None
    overlap: float | None = None
    comm_bytes: int | None = None  # sent per rank per step
    overlap_note: str = ""
    # fusedloss: CUDA graph replay (GRAPH_DEFINITION)
    graphed_ms: float | None = None
    graphed_per_rank: list[float] = field(default_factory=list)
    graphed_note: str = ""

    @property
    def comm_gbps(self) -> float | None:
        if not self.comm_bytes or not self.comm_ms:
            return None
        return self.comm_bytes / (self.comm_ms * 1e-3) / 1e9


@dataclass
class CaseResult:
    case: Case
    reference: Reference | None
    results: dict[str, ProviderResult] = field(default_factory=dict)
    note: str = ""


class _Failed(Exception):
    """A stage failed on some rank (and so on every rank): its result holds the failure."""


def _must(ranks: Ranks, result: Any, device: torch.device, action: Callable[[], Any]) -> Any:
    ok, value = stage(ranks, result, device, action)
    if not ok:
        raise _Failed
    return value


def _timed(ctx: Context, fn: Callable[[], Any], host: bool = False) -> Callable[[], RankTiming]:
    return lambda: time_on_all_ranks(fn, ctx.device, ctx.ranks, ctx.timing, ctx.min_reps, host)


def run_provider(provider: RingProvider, case: Case, leaves: Leaves,
                 reference: Reference | None, ctx: Context, overlap: bool,
                 graph: bool) -> ProviderResult:
    """Build, check, measure memory, time (and for fusedloss the overlap and graph replay) on
    every rank; never raises: a failure on any rank is the row's status on every rank."""
    ranks, device = ctx.ranks, ctx.device
    result = ProviderResult(provider.key, provider.display_name())
    loss_fn: Any = None
    error: Error | None = None
    try:
        loss_fn = provider.build(ctx, case)
    except Unavailable as exc:
        not_installed = provider.is_peer and "not importable" in str(exc)
        error = (NOT_INSTALLED if not_installed else UNAVAILABLE, str(exc))
    except Exception as exc:
        error = (FAILED, common.describe_error(exc))
    if not agree(ranks, result, error):
        return result
    result.call = provider.call

    needed = provider.required_bytes(case, torch.empty((), dtype=ctx.dtype).element_size())
    if needed and common.uses_cuda(device):
        common.release_memory(device)
        free = ranks.min(float(torch.cuda.mem_get_info(device)[0]))
        if needed > free:
            result.status = OUT_OF_MEMORY
            result.note = (f"not run: its b_r×B logits need ≥ {needed / 2**30:.1f} GiB per rank, "
                           f"{free / 2**30:.1f} GiB free (predicted, so that no rank runs out "
                           "alone and leaves the others waiting)")
            return result

    def forward_backward() -> tuple[Tensor, ...]:
        return torch.autograd.grad(loss_fn(*leaves), leaves)

    try:
        # The check: forward, agree, backward, agree (a failure on one rank stops all).
        common.release_memory(device)
        common.synchronize(device)
        begin = time.perf_counter()
        loss = _must(ranks, result, device, lambda: loss_fn(*leaves))
        grads = _must(ranks, result, device, lambda: torch.autograd.grad(loss, leaves))
        common.synchronize(device)
        result.first_call_ms = ranks.max((time.perf_counter() - begin) * 1e3)
        _check(result, provider, ranks, case, loss, grads, reference)
        loss = grads = None  # frees the check call's graph and gradients
        common.release_memory(device)
        if common.uses_cuda(device):
            gradient_bytes = sum(t.numel() * t.element_size() for t in leaves)
            result.peak_per_rank = ranks.gather(_must(ranks, result, device, lambda: (
                common.peak_extra_mib(forward_backward, device, gradient_bytes))))
            result.peak_extra_mib = max(result.peak_per_rank)
        timed = _must(ranks, result, device,
                      _timed(ctx, forward_backward, host=provider.key == FUSEDLOSS))
    except _Failed:
        return result
    result.ms_per_rank, result.ms, result.reps = timed.per_rank_ms, timed.ms, timed.reps
    result.host_per_rank = timed.per_rank_host_ms
    result.host_ms = max(timed.per_rank_host_ms) if timed.per_rank_host_ms else None
    how = "CUDA events" if common.uses_cuda(device) else "wall clock"
    result.timing = f"median of {timed.reps} calls ({how}), max over ranks"
    common.release_memory(device)

    if provider.key == FUSEDLOSS and overlap:
        measure_overlap(result, forward_backward, ctx)
    if provider.key == FUSEDLOSS and graph:
        measure_graphed(result, forward_backward, ctx)
    return result


def _check(result: ProviderResult, provider: RingProvider, ranks: Ranks, case: Case,
           loss: Tensor, grads: Sequence[Tensor], reference: Reference | None) -> None:
    """The ranks' mean loss (and gradients ÷ K) against the reference; collectives."""
    problems = []
    result.rank_losses = ranks.gather(float(loss.detach().float()))
    result.loss = math.fsum(result.rank_losses) / ranks.world
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    if ranks.min(1.0 if finite else 0.0) < 1.0:
        problems.append("gradients not finite (on some rank)")
    if not math.isfinite(result.loss):
        problems.append(f"loss {result.loss}")
    if reference is None:
        result.check = "finite" if provider.key == FUSEDLOSS else ""
    else:
        result.check = reference.dtype
        result.loss_error, loss_problems = common.check_loss(result.loss, reference.loss,
                                                             LOSS_TOLERANCE)
        problems += loss_problems
    if reference is not None and reference.grads is not None:
        rows = slice(ranks.rank * case.per_rank, (ranks.rank + 1) * case.per_rank)
        result.errors = {
            name: ranks.relative_error(grad.double() / ranks.world, reference.grads[name][rows])
            for name, grad in zip(("dI", "dT"), grads[:2], strict=True)}
        scale = float(grads[2].double())
        value = (scale if provider.scale_grad_summed else ranks.sum(scale)) / ranks.world
        ref_scale = float(reference.grads["ds"])
        result.errors["ds"] = abs(value - ref_scale) / abs(ref_scale) if ref_scale else abs(value)
        for name, value in result.errors.items():
            bound = SCALAR_ERROR_BOUND if name == "ds" else GRADIENT_ERROR_BOUND
            if not value <= bound:  # NaN fails too
                problems.append(f"{name} relative error {value:.2e} > {bound}")
    common.mark_wrong(result, problems)


def measure_overlap(result: ProviderResult, forward_backward: Callable[[], Any],
                    ctx: Context) -> None:
    """(b) compute only and (c) transfers only, from one recorded step (OVERLAP_DEFINITION)."""
    ranks, device = ctx.ranks, ctx.device
    recording = ShiftRecording()
    probe = ProviderResult(result.provider, result.label)  # takes a failure, if any

    def record() -> None:
        with ring_shift_replaced(recording_shift(recording)):
            forward_backward()
        common.synchronize(device)

    def compute_only() -> RankTiming:
        replay = ComputeOnly(recording)
        with ring_shift_replaced(replay.shift_class()):
            return _timed(ctx, replay.wrap(forward_backward))()

    try:
        _must(ranks, probe, device, record)
        result.comm_bytes = int(ranks.max(float(recording.bytes_sent)))
        compute = _must(ranks, probe, device, compute_only)
        result.compute_ms, result.compute_per_rank = compute.ms, compute.per_rank_ms
        result.exposed_comm_ms = exposed_comm_ms(result.ms, result.compute_ms)
        recording.release()
        common.release_memory(device)
        if ranks.max(float(len(recording.shifts))) == 0:
            result.overlap_note = f"K = {ranks.world}: the ring makes no transfers"
            return
        comm = _must(ranks, probe, device, _timed(ctx, transfers_only(recording, device)))
        result.comm_ms, result.comm_per_rank = comm.ms, comm.per_rank_ms
        result.overlap = overlap_fraction(result.ms, result.compute_ms, result.comm_ms)
    except _Failed:
        result.overlap_note = f"overlap not measured: {probe.status}: {probe.note}"
    finally:
        recording.release()
        common.release_memory(device)


def graphed_step(forward_backward: Callable[[], tuple[Tensor, ...]],
                 device: torch.device) -> Callable[[], None]:
    """The step captured once in a CUDA graph; raises if a replay's gradients differ from an
    eager call's."""
    graph, captured = common.capture_graph(forward_backward, forward_backward, device,
                                           GRAPH_WARMUP_CALLS)
    graph.replay()
    eager = forward_backward()
    if not all(torch.equal(c, e) for c, e in zip(captured, eager, strict=True)):
        raise RuntimeError("a replay's gradients differ from an eager call's")
    return graph.replay


def measure_graphed(result: ProviderResult, forward_backward: Callable[[], Any],
                    ctx: Context) -> None:
    """The step replayed from a CUDA graph, timed like the step (GRAPH_DEFINITION)."""
    ranks, device = ctx.ranks, ctx.device
    if not common.uses_cuda(device):
        result.graphed_note = "not graphed: CUDA graphs need a CUDA device"
        return
    probe = ProviderResult(result.provider, result.label)  # takes a failure, if any
    replay: list[Callable[[], None]] = []
    try:
        replay.append(_must(ranks, probe, device, lambda: graphed_step(forward_backward, device)))
        timed = _must(ranks, probe, device, _timed(ctx, replay[0]))
        result.graphed_ms, result.graphed_per_rank = timed.ms, timed.per_rank_ms
    except _Failed:
        result.graphed_note = f"not graphed: {probe.status}: {probe.note}"
    finally:
        replay.clear()  # frees the graph and its memory pool
        common.release_memory(device)


def cross_check(case_result: CaseResult) -> None:
    """Without a reference: each peer's mean loss against fusedloss's."""
    if case_result.reference is not None:
        return
    ours = case_result.results.get(FUSEDLOSS)
    usable = (ours is not None and ours.measured and ours.loss is not None
              and math.isfinite(ours.loss))
    for key, result in case_result.results.items():
        if key == FUSEDLOSS or not result.measured or result.loss is None:
            continue
        if not usable:
            result.check = "unchecked (no reference, no fusedloss loss)"
            continue
        result.check = "fusedloss"
        result.loss_error, problems = common.check_loss(result.loss, ours.loss, LOSS_TOLERANCE)
        if problems:
            problem = f"{problems[0]} (fusedloss's)"
            if result.status == WRONG:
                result.note += "; " + problem
            else:
                common.mark_wrong(result, [problem])


def run_cases(cases: Sequence[Case], providers: Sequence[RingProvider], ctx: Context,
              overlap: bool, graph: bool,
              after_case: Callable[[list[CaseResult]], None] = lambda _results: None
              ) -> list[CaseResult]:
    """Every case with every provider; ``after_case(results so far)`` after each case (rank 0
    writes the results files there, so that a run stopped midway keeps its finished cases)."""
    ranks, device, say = ctx.ranks, ctx.device, ctx.say
    case_results = []
    for case in cases:
        cr = CaseResult(case, None)
        case_results.append(cr)
        made = ProviderResult("inputs", "inputs")
        ok, value = stage(ranks, made, device,
                          lambda case=case: make_inputs(case, ranks.rank, ctx))
        if not ok:
            cr.note = f"inputs could not be made: {made.status}: {made.note}"
            say(f"[{case.key}] {cr.note}")
            continue
        inputs, cr.reference, cr.note = value
        del value
        common.release_memory(device)
        say(f"[{case.key}] clip {case.label}, logit_scale {case.logit_scale:.4g}: " + (
            cr.note if cr.reference is None
            else f"reference loss {cr.reference.loss:.4f} ({cr.reference.dtype})"))
        for provider in providers:
            result = run_provider(provider, case, inputs, cr.reference, ctx, overlap, graph)
            cr.results[provider.key] = result
            say(f"  {case.key:<20} {result.label:<24} "
                f"{common.progress_line(result, _figures_text)}")
        cross_check(cr)
        del inputs
        common.release_memory(device)
        after_case(case_results)
    return case_results


def _figures_text(r: ProviderResult) -> str:
    text = f"{_ms(r.ms)} ms, {_mib(r.peak_extra_mib)} MB, loss {r.loss:.5g}"
    if r.errors:
        text += ", " + errors_text(r)
    if r.compute_ms is not None:
        text += (f"; compute only {_ms(r.compute_ms)} ms, transfers only {_ms(r.comm_ms)} ms, "
                 f"overlap {_percent(r.overlap)}")
    elif r.overlap_note:
        text += f"; {r.overlap_note}"
    if r.graphed_ms is not None:
        text += f"; replayed as a CUDA graph {_ms(r.graphed_ms)} ms"
    elif r.graphed_note:
        text += f"; {r.graphed_note}"
    return text


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _signed_ms(value: float | None) -> str:
    return "—" if value is None else ("−" if value < 0 else "") + _ms(abs(value))


def _number(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def per_rank_text(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    return " / ".join(fmt(v) for v in values) if values else "—"


def errors_text(result: Any) -> str:
    if not result.errors:
        return "—"
    return ", ".join(f"{name} {value:.1e}" for name, value in result.errors.items())


def _check_text(r: ProviderResult) -> str:
    return r.check or "—" if r.loss_error is None else f"{r.loss_error:.1e} ({r.check})"


Column = tuple[str, Callable[..., str]]


def _on_pairs(columns: Sequence[Column]) -> list[Column]:
    """Columns of ``cell(cr, r)`` as columns of one ``(cr, r)`` row item each."""
    return [(header, lambda row, cell=cell: cell(*row)) for header, cell in columns]


# (case result, fusedloss's result) of a case where fusedloss was measured
OVERLAP_COLUMNS: list[Column] = _on_pairs([
    ("case", lambda cr, r: cr.case.label),
    ("a: ring", lambda cr, r: _ms(r.ms)),
    ("host", lambda cr, r: _ms(r.host_ms)),
    ("graphed", lambda cr, r: _ms(r.graphed_ms)),
    ("b: compute only", lambda cr, r: _ms(r.compute_ms)),
    ("c: transfers only", lambda cr, r: _ms(r.comm_ms)),
    ("exposed a − b", lambda cr, r: _signed_ms(r.exposed_comm_ms)),
    ("overlap", lambda cr, r: _percent(r.overlap)),
    ("MB sent / rank", lambda cr, r: _number(None if r.comm_bytes is None
                                              else r.comm_bytes / 2**20, ".1f")),
    ("GB/s", lambda cr, r: _number(r.comm_gbps, ".1f")),
    ("note", lambda cr, r: "; ".join(n for n in (r.overlap_note, r.graphed_note) if n)),
])
# (case result, a provider's result)
ALL_FIGURES_COLUMNS: list[Column] = _on_pairs([
    ("case", lambda cr, r: cr.case.key),
    ("provider", lambda cr, r: r.label),
    ("status", lambda cr, r: r.status),
    ("ms", lambda cr, r: _ms(r.ms)),
    ("ms per rank", lambda cr, r: per_rank_text(r.ms_per_rank, _ms)),
    ("calls", lambda cr, r: _number(r.reps, "d")),
    ("MB", lambda cr, r: _mib(r.peak_extra_mib)),
    ("MB per rank", lambda cr, r: per_rank_text(r.peak_per_rank, _mib)),
    ("× floor", lambda cr, r: common.format_ratio(r.times_floor)),
    ("loss", lambda cr, r: _number(r.loss, ".5f")),
    ("|loss − ref| (ref)", lambda cr, r: _check_text(r)),
    ("gradient errors", lambda cr, r: errors_text(r)),
    ("first call ms", lambda cr, r: _ms(r.first_call_ms)),
    ("note", lambda cr, r: r.note),
])
SHORT_COLUMNS: list[Column] = _on_pairs([
    (header, lambda cr, r, i=i: common.summary_cells(cr.case.key, r)[i])
    for i, header in enumerate(common.SUMMARY_HEADERS)
] + [
    ("overlap", lambda cr, r: _percent(r.overlap) if r.provider == FUSEDLOSS else ""),
    ("exposed ms", lambda cr, r: _signed_ms(r.exposed_comm_ms) if r.provider == FUSEDLOSS
     else ""),
    ("|loss − ref|", lambda cr, r: _check_text(r) if r.measured else ""),
])


def _all_rows(case_results: Sequence[CaseResult]) -> list[tuple[CaseResult, ProviderResult]]:
    return [(cr, r) for cr in case_results for r in cr.results.values()]


def render_markdown(info: dict[str, Any], case_results: Sequence[CaseResult]) -> str:
    env, s = info["environment"], info["settings"]
    cuda = common.uses_cuda(env["device"])
    units = ("GPU", "GPUs") if cuda else ("CPU process", "CPU processes")
    lines = [f"# Ring CLIP over {s['world_size']} × {env['device_name']}, {env['date']}", ""]
    if s["quick"]:
        lines += ["> **--quick run**: tiny batches and short timing. A smoke test of the runner; "
                  "the figures are not representative.", ""]
    settings_rows = [
        *common.environment_rows(env, info["peer_versions"], f", backend {s['backend']}"),
        ("ranks", f"K = {s['world_size']} ({units[s['world_size'] > 1]}), torch.distributed "
                  f"backend {s['dist_backend']}"),
        ("dtype, width, seed", f"{s['dtype']}, c = {s['width']}, seed {s['seed']}"),
        common.matmul_row(info["matmul"]),
        ("timing", f"{TIMING_DEFINITION}; warmup {s['warmup_ms']:g} ms, rep {s['rep_ms']:g} ms, "
                   f"min_reps {s['min_reps']}" + ("" if cuda else "; " + common.WALL_CLOCK_TIMING)),
        ("memory", RING_MEMORY_DEFINITION),
        ("overlap", OVERLAP_DEFINITION if s["overlap"] else "not measured (--no-overlap)"),
        ("CUDA graph", GRAPH_DEFINITION if s["graph"] else "not measured (without --graph)"),
        ("check", CHECK_DEFINITION),
        ("inputs", INPUTS_DEFINITION),
        ("floor", FLOOR_DEFINITION),
    ]
    lines += [common.markdown_table(["setting", "value"], settings_rows), ""]

    columns = common.provider_columns(case_results)
    time_memory: list[Column] = [
        ("case (B×c (K×b_r) regime)", lambda cr: cr.case.label),
        *[(label, lambda cr, key=key: common.time_and_memory_cell(cr.results.get(key), "—"))
          for key, label in columns],
        ("fusedloss × floor", lambda cr: common.format_ratio(cr.results[FUSEDLOSS].times_floor)
         if FUSEDLOSS in cr.results else "—"),
        ("reference loss", lambda cr: f"{cr.reference.loss:.5f} ({cr.reference.dtype})"
         if cr.reference else "— (none)"),
    ]
    lines += ["## Time and memory", "",
              "ms per forward+backward step (max over ranks of each rank's median) / peak MB per "
              "rank above inputs and gradient buffers (max over ranks); — = not run. Losses (mean "
              "over the ranks) in \"All figures\".", "",
              common.table(time_memory, case_results), ""]

    ours = [(cr, cr.results[FUSEDLOSS]) for cr in case_results
            if FUSEDLOSS in cr.results and cr.results[FUSEDLOSS].measured]
    if ours and (s["overlap"] or s["graph"]):
        lines += [
            "## Communication and compute (fusedloss)", "",
            "ms, max over ranks (settings: overlap, CUDA graph); host: the time to issue one "
            f"step started on an idle GPU (median of {HOST_REPS} calls); MB sent per rank per "
            "step and the rate (c) implies.", "",
            common.table(OVERLAP_COLUMNS, ours), ""]

    lines += ["## All figures", "", common.table(ALL_FIGURES_COLUMNS, _all_rows(case_results)), ""]
    lines += common.closing_sections(info["calls"], info["notes"])
    return "\n".join(lines)


def results_json(info: dict[str, Any], case_results: Sequence[CaseResult]) -> dict[str, Any]:
    tflops = info["matmul"]["tflops"]
    return {
        "suite": NAME,
        **info,
        "definitions": {
            "timing": TIMING_DEFINITION, "memory": RING_MEMORY_DEFINITION,
            "overlap": OVERLAP_DEFINITION, "graph": GRAPH_DEFINITION, "check": CHECK_DEFINITION,
            "floor": FLOOR_DEFINITION,
        },
        "cases": [
            {
                "case": cr.case.key, "global_batch": cr.case.batch,
                "per_rank_batch": cr.case.per_rank, "world_size": cr.case.world,
                "width": cr.case.width, "regime": cr.case.regime,
                "logit_scale": cr.case.logit_scale, "floor_ms": cr.case.floor_ms(tflops),
                "reference": None if cr.reference is None else {
                    "loss": cr.reference.loss, "dtype": cr.reference.dtype,
                    "directions": cr.reference.directions,
                },
                "note": cr.note,
                "results": [dict(asdict(r), comm_gbps=r.comm_gbps) for r in cr.results.values()],
            }
            for cr in case_results
        ],
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pick_device(name: str | None) -> torch.device:
    """CUDA (this process's LOCAL_RANK GPU under torchrun) where there is one, else the CPU."""
    device = common.pick_device(name)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def init_process_group(device: torch.device, timeout_s: float) -> tuple[bool, str]:
    """The default group (NCCL on CUDA, gloo on the CPU): from torchrun's environment, or a
    single-process group on a free local port. Returns (created here, backend)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        return False, str(dist.get_backend())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = _dt.timedelta(seconds=timeout_s)
    extra: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, **extra)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1, timeout=timeout, **extra)
    return True, backend


def run_distributed(args: argparse.Namespace, name: str,
                    body: Callable[[argparse.Namespace, Context], int],
                    log: Callable[[str], None]) -> int:
    """A torchrun suite's frame: checks the device and --min-reps, joins (or creates) the
    process group, runs ``body(args, context)`` and leaves the group."""
    device = pick_device(args.device)
    if not common.uses_cuda(device) and not args.quick:
        if int(os.environ.get("RANK", "0")) == 0:
            log(f"the {name} suite needs CUDA devices at full size; use --quick on a CPU")
        return 2
    if getattr(args, "min_reps", 1) < 1:
        log("--min-reps must be at least 1")
        return 2
    created, dist_backend = init_process_group(device, GROUP_TIMEOUT_S)
    # gloo can abort (SIGABRT) at interpreter exit ("terminate called without an active
    # exception"), after point-to-point transfers and, rarely, in a group of one: a process whose
    # group this created leaves, once the group is destroyed, without the C++ destructors.
    hard_exit = created and dist_backend == "gloo"
    try:
        code = body(args, make_context(args, device, dist_backend, log))
    except Exception:
        if not hard_exit:
            raise
        traceback.print_exc()
        code = 1
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    if hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batches", type=positive_int_list, default=None,
        help="comma list of global batches B, each split evenly over the K ranks (default "
        f"{','.join(map(str, DEFAULT_BATCHES))}; {','.join(map(str, QUICK_BATCHES))} with "
        "--quick)")
    parser.add_argument(
        "--width", type=int, default=None,
        help=f"feature width c (default {DEFAULT_WIDTH}; {QUICK_WIDTH} with --quick)")
    parser.add_argument(
        "--providers", type=common.comma_list(PROVIDER_KEYS), default=list(PROVIDER_KEYS),
        help=f"comma list of {', '.join(PROVIDER_KEYS)} (default: all)")
    common.add_dtype_seed_arguments(parser)
    common.add_quick_device_timing_arguments(
        parser, "batches 256,512, c = 64, short timing: a smoke test that also runs on CPU "
        "(gloo)")
    parser.add_argument(
        "--min-reps", type=int, default=DEFAULT_MIN_REPS,
        help=f"at least this many timed calls per figure (default {DEFAULT_MIN_REPS})")
    parser.add_argument("--no-overlap", action="store_true",
                        help="skip fusedloss's compute-only and transfers-only measurements")
    parser.add_argument("--graph", action="store_true",
                        help="also time fusedloss's step replayed from a CUDA graph (CUDA only)")
    common.add_matmul_output_arguments(parser)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    return run_distributed(args, "ring", _run, log)


def _run(args: argparse.Namespace, ctx: Context) -> int:
    ranks, say, env = ctx.ranks, ctx.say, ctx.environment
    batches = args.batches or list(QUICK_BATCHES if ctx.quick else DEFAULT_BATCHES)
    width = args.width or (QUICK_WIDTH if ctx.quick else DEFAULT_WIDTH)
    try:
        cases = select_cases(batches, width, ranks.world)
    except ValueError as error:
        say(str(error))
        return 2
    overlap, graph = not args.no_overlap, bool(args.graph)
    all_providers = ring_providers(ctx.backend)
    providers = [all_providers[key] for key in args.providers]
    if ranks.rank == 0:
        say(f"ring on {ranks.world} × {env['device_name']} ({ctx.dist_backend}): torch "
            f"{env['torch']}, triton {env['triton']}, {common.dtype_name(ctx.dtype)}, "
            f"c = {width}, fusedloss backend {ctx.backend}, cases: "
            f"{', '.join(case.key for case in cases)}")
    matmul = ctx.probe_matmul(args.matmul_size)

    def write(results: list[CaseResult], final: bool = False) -> None:
        """Rank 0: the results files of the cases so far (and at the end the notes and the
        short table on the log)."""
        if ranks.rank != 0:
            return
        calls, notes = collect_calls_notes(results, ctx.notes)
        for cr in results:
            for r in cr.results.values():
                r.times_floor = r.ms / cr.case.floor_ms(matmul["tflops"]) if r.measured else None
        info = {
            "environment": env,
            "settings": {
                "world_size": ranks.world, "dist_backend": ctx.dist_backend,
                "dtype": common.dtype_name(ctx.dtype), "width": width, "batches": list(batches),
                "regimes": [REGIME], "seed": ctx.seed, "quick": ctx.quick,
                "warmup_ms": ctx.timing.warmup_ms, "rep_ms": ctx.timing.rep_ms,
                "min_reps": ctx.min_reps, "backend": ctx.backend,
                "providers": list(args.providers), "overlap": overlap, "graph": graph,
            },
            "matmul": matmul,
            "peer_versions": {name: common.package_version(name)
                              for name in ("inf-cl", "open-clip-torch")},
            "calls": calls,
            "notes": notes,
        }
        common.report_results(
            args.out, NAME, args.tag, env, notes, markdown=render_markdown(info, results),
            payload=results_json(info, results), world=ranks.world,
            tables=common.table(SHORT_COLUMNS, _all_rows(results), text=True),
            log=say if final else lambda _line: None)

    case_results = run_cases(cases, providers, ctx, overlap, graph, write)
    try:
        write(case_results, final=True)
    finally:
        ranks.barrier()  # every rank leaves once the results are written
    return 0


def collect_calls_notes(case_results: Sequence[Any], notes: Sequence[str]
                        ) -> tuple[dict[str, str], list[str]]:
    """The calls measured (by provider label) and the run's notes: ``notes``, then each case's
    note and problems."""
    calls: dict[str, str] = {}
    notes = list(notes)
    for cr in case_results:
        if cr.note:
            notes.append(f"{cr.case.key}: {cr.note}")
        for result in cr.results.values():
            if result.call:
                calls.setdefault(result.label, result.call)
            common.note_problem(notes, cr.case.key, result)
    return calls, notes


SUITE = Suite(
    name=NAME,
    help="CLIP over K processes (torchrun): fusedloss's ring against inf-cl and open_clip, "
    "with the ring's communication overlap",
    add_arguments=add_arguments,
    run=run,
)
