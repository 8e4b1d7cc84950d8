"""Suite ``ring``: CLIP over K processes, fusedloss's ring against inf-cl and open_clip.

    torchrun --nproc_per_node=K benchmarks/run.py ring [options]   # NCCL; gloo with --quick on CPU

Rank r holds the rows r·B/K … (r+1)·B/K − 1 of one global batch B drawn from the seed (the
same loss for every K). Per case and provider: a checked first call, peak memory per rank,
the step time (max over ranks of each rank's median), and for fusedloss the overlap of its
transfers with compute (:data:`OVERLAP_DEFINITION`). The ``Ranks``/``stage``/
``run_distributed`` frame here is shared by the other torchrun suites. Only rank 0 writes
``ring_<date>_<gpu-slug>_<K>gpu[_tag].md/.json``.
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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks import common
from benchmarks.common import FAILED, NOT_INSTALLED, OK, OUT_OF_MEMORY, UNAVAILABLE, WRONG
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
RESULTS_PREFIX = "ring"

FUSEDLOSS = "fusedloss"
INF_CL = "inf-cl"
OPEN_CLIP = "open-clip"
PROVIDER_KEYS = (FUSEDLOSS, INF_CL, OPEN_CLIP)

DEFAULT_BATCHES = (65_536, 131_072, 262_144, 524_288, 1_048_576)
DEFAULT_WIDTH = 512
QUICK_BATCHES = (256, 512)
QUICK_WIDTH = 64

# Repetitions of a timed function: clamp(rep_ms / estimate, min_reps, MAX_REPS) calls after
# min(warmup_ms / estimate, MAX_WARMUP) warm-up calls, the same numbers on every rank.
DEFAULT_MIN_REPS = 3
MAX_REPS = 1000
MAX_WARMUP = 100
GROUP_TIMEOUT_S = 1800.0  # torch.distributed's timeout of a collective
REGIME = "random"  # make_pair_features' regime of every case

TIMING_DEFINITION = (
    "ms = max over the ranks of each rank's median time of one step, forward+backward "
    "`torch.autograd.grad(loss(image_r, text_r, logit_scale), (image_r, text_r, logit_scale))` "
    "on the rank's b_r = B/K pairs. Every rank makes the same number of calls: n = clamp(rep_ms "
    "/ estimate, min_reps, 1000) after min(warmup_ms / estimate, 100) warm-up calls (estimate: "
    "the slowest rank's synchronized call), starting together after a barrier; CUDA events "
    "(wall clock without CUDA), no L2 flush"
)
OVERLAP_DEFINITION = (
    "fusedloss only. (a) ring: the step as timed above. (b) compute only: the same step with "
    "every `Shift` of fusedloss/distributed/ring.py replaced by one that copies into the "
    "receive buffers the tensors a recorded real step received (the ring reads them through "
    "views of those buffers; (b) includes the copies), so every engine call sees the same "
    "blocks, statistics and masses as in (a). (c) transfers only: the recorded shifts (sizes, "
    "dtypes, tags, posting and waiting order, same Shift class) without compute. Each timed "
    "like (a). overlap = (b + c − a) / min(b, c) clamped to [0, 1]; exposed communication = "
    "a − b (negative: noise). K = 1 makes no transfers: (c) and overlap —"
)
GRAPH_DEFINITION = (
    "fusedloss only, with --graph, on CUDA: the step captured once in a torch.cuda.CUDAGraph "
    "(warm-up on a side stream; the captured call reuses the last eager call's exchange of "
    "facts) and timed like (a) by replaying it, reading the inputs in place. One replay's "
    "gradients must equal an eager call's bit for bit"
)
RING_MEMORY_DEFINITION = (
    MEMORY_DEFINITION + " Per rank, on its b_r rows (gradient bytes: its dI, dT and d "
    "logit_scale); MB = the max over the ranks. NCCL's own buffers are not allocated through "
    "PyTorch's caching allocator and are not counted."
)
CHECK_DEFINITION = (
    "first, untimed call: the ranks' mean loss (= the global loss L for every provider) "
    f"within {LOSS_TOLERANCE}·max(1, |ref|) of a reference of the global batch: float64 with "
    f"gradients while B²·c ≤ 2^40, a float32 loss (TF32) while B ≤ {REFERENCE_LOSS_MAX_ROWS}; "
    "above, the peers' losses against fusedloss's (fusedloss only checked finite). Gradients: "
    "relative L2 error over the global batch of dI, dT ÷ K and of d logit_scale (summed over "
    f"the ranks ÷ K; inf-cl sums it itself), bounds {GRADIENT_ERROR_BOUND} (features), "
    f"{SCALAR_ERROR_BOUND} (scale). Failing rows are 'wrong' and still timed"
)


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One global batch B of pairs of width c over K ranks."""

    batch: int  # B, global
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
        """The one-pass cost floor (docs/design.md) of one rank's b_r × B share: 8·b_r·B·c / R."""
        return 8.0 * self.per_rank * self.batch * self.width / (tflops * 1e12) * 1e3

    @property
    def reference_grads(self) -> bool:
        return self.batch**2 * self.width <= REFERENCE_GRADS_MAX_WORK

    @property
    def reference_loss(self) -> bool:
        return self.batch <= REFERENCE_LOSS_MAX_ROWS


def select_cases(batches: Sequence[int], width: int, world: int) -> list[Case]:
    """Every global batch; each must split evenly over the ``world`` ranks."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    uneven = [b for b in batches if b < world or b % world]
    if uneven:
        raise ValueError(
            f"global batches {uneven} do not split evenly over {world} ranks "
            "(each rank holds B / K pairs)"
        )
    return [Case(batch, world, width) for batch in batches]


def overlap_fraction(ring_ms: float | None, compute_ms: float | None,
                     comm_ms: float | None) -> float | None:
    """(b + c − a) / min(b, c) clamped to [0, 1] (a: step, b: compute only, c: transfers
    only); None where a figure is missing or not finite, or min(b, c) ≤ 0."""
    values = (ring_ms, compute_ms, comm_ms)
    if any(v is None or not math.isfinite(v) for v in values):
        return None
    shorter = min(compute_ms, comm_ms)
    if shorter <= 0:
        return None
    return min(1.0, max(0.0, (compute_ms + comm_ms - ring_ms) / shorter))


def exposed_comm_ms(ring_ms: float | None, compute_ms: float | None) -> float | None:
    """a − b: the time the step spends beyond its compute (transfers not hidden)."""
    if ring_ms is None or compute_ms is None:
        return None
    return ring_ms - compute_ms


def results_stem(date: str, device_slug: str, world: int, cuda: bool, tag: str | None) -> str:
    """``ring_2026-12-01_nvidia-h100-80gb-hbm3_8gpu`` (``_TAG`` appended when given); K CPU
    processes: ``ring_<date>_cpu_<K>proc``."""
    unit = "gpu" if cuda else "proc"
    return common.results_stem(RESULTS_PREFIX, date, f"{device_slug}_{world}{unit}", tag)


def positive_int_list(text: str) -> list[int]:
    """An argparse ``type``: ``65536,131072`` → [65536, 131072] (each ≥ 1)."""
    try:
        values = [int(v.strip().replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from error
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


# ----------------------------------------------------------------------------- the ranks


@dataclass
class Ranks:
    """This process's place in the default group, and the few collectives the suite makes.

    Every method is a collective: every rank must call it, in the same order. Values travel as
    float64 tensors on ``device`` (the GPU for NCCL, the CPU for gloo)."""

    rank: int
    world: int
    device: torch.device

    def _values(self, values: Sequence[float]) -> Tensor:
        return torch.tensor(list(values), dtype=torch.float64, device=self.device)

    def gather(self, value: float) -> list[float]:
        """Every rank's ``value``, in rank order."""
        local = self._values([value])
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
        """Relative L2 error of a tensor split over the ranks: (Σ_r ‖a_r − ref_r‖² /
        Σ_r ‖ref_r‖²)^½ in float64."""
        a, r = actual.double(), reference.double()
        diff, norm = self.sum(float(((a - r) ** 2).sum())), self.sum(float((r**2).sum()))
        return math.sqrt(diff / norm) if norm > 0 else (0.0 if diff == 0 else math.inf)

    def objects(self, value: Any) -> list[Any]:
        """Every rank's picklable ``value``, in rank order."""
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
    rank, (status, note) = next(
        ((r, e) for r, e in failed if e[0] == OUT_OF_MEMORY), failed[0]
    )
    result.status = status
    if ranks.world > 1 and not (len(failed) == ranks.world and len(set(errors)) == 1):
        others = [r for r, _ in failed if r != rank]
        note = f"rank {rank}: {note}" + (f" (also ranks {others})" if others else "")
    result.note = note  # the same failure on every rank: said once
    return False


def stage(ranks: Ranks, result: Any, device: torch.device,
          action: Callable[[], Any]) -> tuple[bool, Any]:
    """Runs ``action`` on every rank, then the ranks agree: (True, its value) where every rank
    succeeded, else (False, None) with the failure in ``result`` on every rank."""
    value, error = None, None
    try:
        value = action()
    except Exception as exc:  # reported, and the run goes on with the next provider
        status = OUT_OF_MEMORY if common.is_out_of_memory(exc) else FAILED
        error = (status, common.describe_error(exc))
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


# ----------------------------------------------------------------------------- timing


@dataclass
class RankTiming:
    per_rank_ms: list[float]  # each rank's median
    reps: int
    warmup: int
    # each rank's median time for the host to issue one call that starts on an idle GPU (its
    # return, not the GPU's end); empty where not measured
    per_rank_host_ms: list[float] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return max(self.per_rank_ms)


HOST_REPS = 5  # synchronized calls whose host time is measured


def time_on_all_ranks(fn: Callable[[], Any], device: torch.device, ranks: Ranks,
                      timing: common.TimingSettings, min_reps: int,
                      host: bool = False) -> RankTiming:
    """Each rank's median time of ``fn()`` over the same number of calls on every rank, the
    calls back to back. ``host``: then, over HOST_REPS calls each started on an idle GPU, the
    host's time to issue one (back to back, a call's host time would include its waits for
    the previous call's GPU work: the per-call exchange waits for its transfers)."""
    estimate = max(ranks.max(common.call_ms(fn, device)), 1e-3)
    warmup = min(MAX_WARMUP, int(timing.warmup_ms / estimate))
    reps = max(min_reps, min(MAX_REPS, int(timing.rep_ms / estimate)))
    for _ in range(warmup):
        fn()
    common.synchronize(device)
    ranks.barrier()
    samples = _timed_calls(fn, device, reps)
    timed = RankTiming(ranks.gather(statistics.median(samples)), reps, warmup)
    if host:
        issue = []
        for _ in range(HOST_REPS):
            common.synchronize(device)
            ranks.barrier()
            begin = time.perf_counter()
            fn()
            issue.append((time.perf_counter() - begin) * 1e3)
        common.synchronize(device)
        timed.per_rank_host_ms = ranks.gather(statistics.median(issue))
    return timed


def _timed_calls(fn: Callable[[], Any], device: torch.device, reps: int) -> list[float]:
    """ms of each call: on CUDA between events, on the CPU the wall clock."""
    if common.uses_cuda(device):
        events = []
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        return [float(start.elapsed_time(end)) for start, end in events]
    samples = []
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - begin) * 1e3)
    return samples


# ----------------------------------------------------------------------------- the ring's shifts


@dataclass
class RecordedShift:
    """One ``Shift`` of a recorded ring step: what it sent and what it received."""

    tag: int
    send: list[tuple[tuple[int, ...], torch.dtype]]
    recv_specs: list[tuple[tuple[int, ...], torch.dtype]]
    recv: list[Tensor]  # the tensors as received (dropped by ShiftRecording.release)
    layout: Any  # the layout it went over (the backward's runs the other way round)

    @property
    def bytes_sent(self) -> int:
        return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                   for shape, dtype in self.send)


@dataclass
class ShiftRecording:
    """The shifts of one ring step (forward and backward) in the order the ring made them, and
    its ``("post", i)`` / ``("wait", i)`` events."""

    shifts: list[RecordedShift] = field(default_factory=list)
    events: list[tuple[str, int]] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return sum(shift.bytes_sent for shift in self.shifts)

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
    """fusedloss's ring makes its transfers through ``ring.Shift`` while this is active."""
    ring = _ring_module()
    original = ring.Shift
    ring.Shift = replacement
    try:
        yield
    finally:
        ring.Shift = original


def _specs(tensors: Sequence[Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def recording_shift(recording: ShiftRecording) -> type:
    """A ``Shift`` that makes the real transfer and records it in ``recording``."""
    real_shift = _ring_module().Shift

    class RecordingShift:
        def __init__(self, layout: Any, send: list[Tensor], recv: list[Tensor], tag: int = 0):
            self.index = len(recording.shifts)
            recording.shifts.append(
                RecordedShift(tag, _specs(send), _specs(recv), list(recv), layout)
            )
            recording.events.append(("post", self.index))
            self._shift = real_shift(layout, send, recv, tag=tag)

        def wait(self) -> None:
            recording.events.append(("wait", self.index))
            self._shift.wait()

    return RecordingShift


class ComputeOnly:
    """Replays a recording without transfers: each ``Shift`` copies the recorded tensors into
    its receive buffers (the ring reads them through views, which ``Tensor.set_`` would not
    fill); ``wait`` is free."""

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
    """The recorded step's transfers alone: the same shifts (sizes, dtypes, tags, layouts)
    posted and waited for in the recorded order through the ring's own ``Shift``, from
    zero-filled send buffers into receive buffers kept from call to call (one per shape, dtype
    and tag: shifts in flight together have different tags)."""
    shift_class = _ring_module().Shift
    sends: dict[tuple[Any, ...], Tensor] = {}
    recvs: dict[tuple[Any, ...], Tensor] = {}

    def buffer(pool: dict[tuple[Any, ...], Tensor], key: tuple[Any, ...]) -> Tensor:
        if key not in pool:
            pool[key] = torch.zeros(key[0], dtype=key[1], device=device)
        return pool[key]

    plan = []
    for shift in recording.shifts:
        send = [buffer(sends, spec) for spec in shift.send]
        recv = [buffer(recvs, (*spec, shift.tag + j)) for j, spec in enumerate(shift.recv_specs)]
        plan.append((shift.layout, send, recv, shift.tag))
    events = list(recording.events)

    def run() -> None:
        posted: dict[int, Any] = {}
        for kind, index in events:
            if kind == "post":
                over, send, recv, tag = plan[index]
                posted[index] = shift_class(over, send, recv, tag=tag)
            else:
                posted.pop(index).wait()
        for shift in posted.values():
            shift.wait()

    return run


# ----------------------------------------------------------------------------- providers

LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (image_r, text_r, logit_scale) -> loss


def _import_module(module: str, hint: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise Unavailable(f"{module} not importable: {error} ({hint})") from error


class RingProvider:
    """One CLIP implementation over the group: ``build`` returns ``loss(image_r, text_r,
    logit_scale)`` for this rank's pairs (a scalar whose mean over the ranks is the global
    loss), or raises :class:`Unavailable`."""

    key = ""
    label = ""
    distribution: str | None = None
    is_peer = False
    install_hint = ""
    scale_grad_summed = False  # d logit_scale comes already summed over the ranks

    def version(self) -> str | None:
        return common.package_version(self.distribution) if self.distribution else None

    def display_name(self) -> str:
        version = self.version() if self.is_peer else None
        return f"{self.label} {version}" if version else self.label

    def build(self, ctx: Context, case: Case) -> LossFn:
        raise NotImplementedError

    def describe(self) -> str:
        return ""

    def required_bytes(self, case: Case, dtype: torch.dtype) -> int:
        """A lower bound of the device memory one step needs per rank (0: small)."""
        return 0


class FusedLossRing(RingProvider):
    key = FUSEDLOSS
    label = "fusedloss"
    distribution = "fusedloss"

    def __init__(self, backend: str = "triton"):
        self.backend = backend

    def build(self, ctx: Context, case: Case) -> LossFn:
        distributed = _import_module("fusedloss.distributed", "pip install -e .")
        clip_loss = getattr(distributed, "clip_loss", None)
        if clip_loss is None:
            raise Unavailable("fusedloss.distributed has no clip_loss")
        backend = self.backend
        return lambda image, text, scale: clip_loss(image, text, scale, backend=backend)

    def describe(self) -> str:
        return (f'fusedloss.distributed.clip_loss(image_r, text_r, logit_scale, '
                f'backend="{self.backend}")  (reduction "mean", filter_eps "auto")')


class InfCLRing(RingProvider):
    """inf-cl's ring (``cal_inf_loss`` with the default group initialized: its ``InfProb``),
    called once per direction as its README's CLIP example and ``InfClipLoss`` do, with the
    labels of the rank's own pairs (``arange(b_r)``: inf-cl indexes the rank's own keys).
    Its ``GradientGather`` all-reduces d logit_scale in the backward."""

    key = INF_CL
    label = "inf-cl"
    distribution = "inf-cl"
    is_peer = True
    install_hint = "pip install inf-cl==1.2.1 --no-deps"
    scale_grad_summed = True

    def build(self, ctx: Context, case: Case) -> LossFn:
        module = _import_module("inf_cl", self.install_hint)
        function = getattr(module, "cal_inf_loss", None)
        if function is None:
            raise Unavailable("inf_cl has no cal_inf_loss")
        if ctx.device.type != "cuda":
            raise Unavailable("inf-cl's Triton kernels (inline PTX) need a CUDA device")
        inf_cl_head_dim(case.width)  # raises Unavailable for a width it cannot take
        return inf_clip_loss(function, scale_inside=True)

    def describe(self) -> str:
        return ("((cal_inf_loss(image_r, text_r, labels, logit_scale, head_dim=h) + "
                "cal_inf_loss(text_r, image_r, labels, logit_scale, head_dim=h)) / 2).mean(), "
                "labels = arange(b_r), h = 256 (c % 256 ≠ 0: 128, 64, …)")


class OpenClipRing(RingProvider):
    """open_clip's ``ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True,
    rank=r, world_size=K)``: all-gathers both feature matrices (with gradient) and forms the
    rank's b_r × B logits in both directions."""

    key = OPEN_CLIP
    label = "open_clip ClipLoss"
    distribution = "open-clip-torch"
    is_peer = True
    install_hint = "pip install open-clip-torch --no-deps"

    def build(self, ctx: Context, case: Case) -> LossFn:
        module = _import_module("open_clip.loss", self.install_hint)
        loss_class = getattr(module, "ClipLoss", None)
        if loss_class is None:
            raise Unavailable("open_clip.loss has no ClipLoss")
        # torch ≥ 2.7 deprecates torch.distributed.nn.all_gather, which open_clip calls.
        warnings.filterwarnings("ignore", message=r".*all_gather is deprecated",
                                category=FutureWarning)
        loss = loss_class(local_loss=True, gather_with_grad=True, cache_labels=True,
                          rank=ctx.ranks.rank, world_size=ctx.ranks.world)
        return lambda image, text, scale: loss(image, text, scale)

    def describe(self) -> str:
        return ("open_clip.loss.ClipLoss(local_loss=True, gather_with_grad=True, "
                "cache_labels=True, rank=r, world_size=K)(image_r, text_r, logit_scale)")

    def required_bytes(self, case: Case, dtype: torch.dtype) -> int:
        """The two b_r × B log-softmax outputs its backward keeps (a lower bound)."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * case.per_rank * case.batch * element


def ring_providers(backend: str) -> dict[str, RingProvider]:
    providers: list[RingProvider] = [FusedLossRing(backend), InfCLRing(), OpenClipRing()]
    return {provider.key: provider for provider in providers}


# ----------------------------------------------------------------------------- inputs, reference


@dataclass
class RingInputs:
    """This rank's pairs (leaves) and the learnable logit_scale."""

    image: Tensor  # (b_r, c)
    text: Tensor
    scale: Tensor  # () fp32
    offset: int  # the rank's first global pair

    @property
    def leaves(self) -> tuple[Tensor, Tensor, Tensor]:
        return (self.image, self.text, self.scale)

    @property
    def gradient_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.leaves)


def make_ring_inputs(case: Case, rank: int, *, dtype: torch.dtype, device: torch.device,
                     seed: int, keep_global: bool) -> tuple[RingInputs, tuple[Tensor, Tensor]
                                                            | None]:
    """The rank's rows of the global batch (``make_pair_features(B, c, regime, seed)``, the
    same on every rank and for every K), and the global pair where ``keep_global``."""
    image, text = make_pair_features(case.batch, case.width, case.regime, dtype=dtype,
                                     device=device, seed=seed)
    offset = rank * case.per_rank
    rows = slice(offset, offset + case.per_rank)
    inputs = RingInputs(
        image=image[rows].clone().requires_grad_(True),
        text=text[rows].clone().requires_grad_(True),
        scale=torch.tensor(case.logit_scale, dtype=torch.float32, device=device,
                           requires_grad=True),
        offset=offset,
    )
    if keep_global:
        return inputs, (image, text)
    del image, text
    return inputs, None


def make_reference(case: Case, pair: tuple[Tensor, Tensor] | None
                   ) -> tuple[Reference | None, str]:
    """The global batch's CLIP loss (and gradients where affordable), on every rank."""
    if not case.reference_loss or pair is None:
        return None, (f"no reference above {REFERENCE_LOSS_MAX_ROWS} rows: the peers' losses "
                      "are compared with fusedloss's")
    with_grads = case.reference_grads
    dtype = torch.float64 if with_grads else torch.float32
    try:
        args = (pair[0], pair[1], case.logit_scale)
        return contrastive_reference("clip", args, with_grads=with_grads, dtype=dtype), ""
    except Exception as error:  # an out-of-memory here must not end the run
        return None, f"reference unavailable: {common.describe_error(error)}"


# ----------------------------------------------------------------------------- results


@dataclass
class ProviderResult(common.ProviderResultBase):
    """One provider on one case, as rank 0 reports it (figures agreed over the ranks)."""

    timing: str = ""
    reps: int | None = None
    ms_per_rank: list[float] = field(default_factory=list)
    host_ms: float | None = None  # max over the ranks of each rank's median host time per call
    host_per_rank: list[float] = field(default_factory=list)
    first_call_ms: float | None = None
    peak_extra_mib: float | None = None  # max over the ranks
    peak_per_rank: list[float] = field(default_factory=list)
    loss: float | None = None  # mean over the ranks
    rank_losses: list[float] = field(default_factory=list)
    loss_error: float | None = None
    check: str = ""  # what the loss was compared with
    errors: dict[str, float] = field(default_factory=dict)
    times_floor: float | None = None
    # fusedloss: communication overlap (OVERLAP_DEFINITION)
    compute_ms: float | None = None
    compute_per_rank: list[float] = field(default_factory=list)
    comm_ms: float | None = None
    comm_per_rank: list[float] = field(default_factory=list)
    exposed_comm_ms: float | None = None
    overlap: float | None = None
    comm_bytes: int | None = None  # sent per rank per step
    overlap_note: str = ""
    # fusedloss: the step replayed from a CUDA graph (GRAPH_DEFINITION)
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


@dataclass
class Settings:
    overlap: bool = True
    graph: bool = False


def run_provider(provider: RingProvider, case: Case, inputs: RingInputs,
                 reference: Reference | None, ctx: Context, settings: Settings) -> ProviderResult:
    """Build, check, measure memory, time (and for fusedloss the overlap) on every rank; never
    raises: a failure on any rank becomes the row's status on every rank."""
    ranks, device = ctx.ranks, ctx.device
    result = ProviderResult(provider.key, provider.display_name())
    loss_fn: LossFn | None = None
    error: Error | None = None
    try:
        loss_fn = provider.build(ctx, case)
    except Unavailable as exc:
        status = NOT_INSTALLED if provider.is_peer and "not importable" in str(exc) else UNAVAILABLE
        error = (status, str(exc))
    except Exception as exc:  # reported on every rank
        error = (FAILED, common.describe_error(exc))
    if not agree(ranks, result, error):
        return result
    result.call = provider.describe()
    assert loss_fn is not None

    needed = provider.required_bytes(case, ctx.dtype)
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
        return torch.autograd.grad(loss_fn(*inputs.leaves), inputs.leaves)

    # The check: forward, agree, backward, agree (a failure on one rank stops all of them).
    common.release_memory(device)
    common.synchronize(device)
    begin = time.perf_counter()
    ok, loss = stage(ranks, result, device, lambda: loss_fn(*inputs.leaves))
    if not ok:
        return result

    def backward() -> tuple[Tensor, ...]:
        return torch.autograd.grad(loss, inputs.leaves)

    ok, grads = stage(ranks, result, device, backward)
    if not ok:
        return result
    common.synchronize(device)
    result.first_call_ms = ranks.max((time.perf_counter() - begin) * 1e3)
    _check(result, provider, ranks, inputs, loss, grads, reference)
    loss = grads = None  # frees the check call's graph and gradients
    common.release_memory(device)

    if common.uses_cuda(device):
        ok, peak = stage(ranks, result, device, lambda: common.peak_extra_mib(
            forward_backward, device, inputs.gradient_bytes))
        if not ok:
            return result
        result.peak_per_rank = ranks.gather(peak)
        result.peak_extra_mib = max(result.peak_per_rank)

    ok, timed = stage(ranks, result, device, lambda: time_on_all_ranks(
        forward_backward, device, ranks, ctx.timing, ctx.min_reps,
        host=provider.key == FUSEDLOSS))
    if not ok:
        return result
    result.ms_per_rank, result.ms, result.reps = timed.per_rank_ms, timed.ms, timed.reps
    result.host_per_rank = timed.per_rank_host_ms
    result.host_ms = max(timed.per_rank_host_ms) if timed.per_rank_host_ms else None
    how = "CUDA events" if common.uses_cuda(device) else "wall clock"
    result.timing = f"median of {timed.reps} calls ({how}), max over ranks"
    common.release_memory(device)

    if provider.key == FUSEDLOSS and settings.overlap:
        measure_overlap(result, forward_backward, ctx, settings)
    if provider.key == FUSEDLOSS and settings.graph:
        measure_graphed(result, forward_backward, ctx, settings)
    return result


def _check(result: ProviderResult, provider: RingProvider, ranks: Ranks, inputs: RingInputs,
           loss: Tensor, grads: Sequence[Tensor], reference: Reference | None) -> None:
    """The ranks' mean loss (and gradients) against the reference; collectives on every rank."""
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
        if reference.grads is not None:
            result.errors = _gradient_errors(provider, ranks, inputs, grads, reference.grads)
            for name, value in result.errors.items():
                bound = SCALAR_ERROR_BOUND if name == "ds" else GRADIENT_ERROR_BOUND
                if not value <= bound:  # NaN fails too
                    problems.append(f"{name} relative error {value:.2e} > {bound}")
    common.mark_wrong(result, problems)


def _gradient_errors(provider: RingProvider, ranks: Ranks, inputs: RingInputs,
                     grads: Sequence[Tensor], reference: dict[str, Tensor]) -> dict[str, float]:
    """Relative L2 errors over the global batch of the ranks' gradients ÷ K."""
    rows = slice(inputs.offset, inputs.offset + inputs.image.shape[0])
    errors = {name: ranks.relative_error(grad.double() / ranks.world, reference[name][rows])
              for name, grad in zip(("dI", "dT"), grads[:2], strict=True)}
    scale = float(grads[2].double())
    total = scale if provider.scale_grad_summed else ranks.sum(scale)
    ref_scale = float(reference["ds"])
    value = total / ranks.world
    errors["ds"] = abs(value - ref_scale) / abs(ref_scale) if ref_scale else abs(value)
    return errors


def measure_overlap(result: ProviderResult, forward_backward: Callable[[], Any], ctx: Context,
                    settings: Settings) -> None:
    """(b) compute only and (c) transfers only, from one recorded step (OVERLAP_DEFINITION)."""
    ranks, device = ctx.ranks, ctx.device
    recording = ShiftRecording()
    probe = ProviderResult(result.provider, result.label)  # takes a failure, if any

    def record() -> None:
        with ring_shift_replaced(recording_shift(recording)):
            out = forward_backward()
        common.synchronize(device)
        del out

    try:
        ok, _ = stage(ranks, probe, device, record)
        if ok:
            result.comm_bytes = int(ranks.max(float(recording.bytes_sent)))
            replay = ComputeOnly(recording)

            def compute_only() -> RankTiming:
                with ring_shift_replaced(replay.shift_class()):
                    return time_on_all_ranks(replay.wrap(forward_backward), device, ranks,
                                             ctx.timing, ctx.min_reps)

            ok, compute = stage(ranks, probe, device, compute_only)
            if ok:
                result.compute_ms, result.compute_per_rank = compute.ms, compute.per_rank_ms
                result.exposed_comm_ms = exposed_comm_ms(result.ms, result.compute_ms)
        recording.release()
        common.release_memory(device)
        if ok and ranks.max(float(len(recording.shifts))) == 0:
            result.overlap_note = f"K = {ranks.world}: the ring makes no transfers"
        elif ok:
            ok, comm = stage(ranks, probe, device, lambda: time_on_all_ranks(
                transfers_only(recording, device), device, ranks, ctx.timing,
                ctx.min_reps))
            if ok:
                result.comm_ms, result.comm_per_rank = comm.ms, comm.per_rank_ms
                result.overlap = overlap_fraction(result.ms, result.compute_ms, result.comm_ms)
    finally:
        recording.release()
        common.release_memory(device)
    if probe.status != OK:
        result.overlap_note = f"overlap not measured: {probe.status}: {probe.note}"


GRAPH_WARMUP_CALLS = 2


def graphed_step(forward_backward: Callable[[], tuple[Tensor, ...]],
                 device: torch.device) -> Callable[[], None]:
    """``forward_backward`` captured once in a CUDA graph, and the graph's replay
    (GRAPH_DEFINITION); raises if a replay's gradients differ from an eager call's."""
    graph, captured = common.capture_graph(forward_backward, forward_backward, device,
                                           GRAPH_WARMUP_CALLS)
    graph.replay()
    eager = forward_backward()
    if not all(torch.equal(c, e) for c, e in zip(captured, eager, strict=True)):
        raise RuntimeError("a replay's gradients differ from an eager call's")
    return graph.replay


def measure_graphed(result: ProviderResult, forward_backward: Callable[[], Any], ctx: Context,
                    settings: Settings) -> None:
    """The step replayed from a CUDA graph, timed like the step (GRAPH_DEFINITION)."""
    ranks, device = ctx.ranks, ctx.device
    if not common.uses_cuda(device):
        result.graphed_note = "not graphed: CUDA graphs need a CUDA device"
        return
    probe = ProviderResult(result.provider, result.label)  # takes a failure, if any
    replay: list[Callable[[], None]] = []
    try:
        ok, _ = stage(ranks, probe, device,
                      lambda: replay.append(graphed_step(forward_backward, device)))
        if ok:
            ok, timed = stage(ranks, probe, device, lambda: time_on_all_ranks(
                replay[0], device, ranks, ctx.timing, ctx.min_reps))
            if ok:
                result.graphed_ms, result.graphed_per_rank = timed.ms, timed.per_rank_ms
    finally:
        replay.clear()  # frees the graph and its memory pool
        common.release_memory(device)
    if probe.status != OK:
        result.graphed_note = f"not graphed: {probe.status}: {probe.note}"


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
              settings: Settings, log: Callable[[str], None],
              after_case: Callable[[list[CaseResult]], None] | None = None
              ) -> list[CaseResult]:
    """Every case with every provider; ``after_case(results so far)`` after each case (rank 0
    writes the results files there, so that a run stopped midway keeps its finished cases)."""
    ranks, device = ctx.ranks, ctx.device
    case_results = []
    for case in cases:
        case_result = CaseResult(case, None)
        case_results.append(case_result)
        made = ProviderResult("inputs", "inputs")

        def make(case: Case = case) -> tuple[RingInputs, Reference | None, str]:
            inputs, pair = make_ring_inputs(
                case, ranks.rank, dtype=ctx.dtype, device=device, seed=ctx.seed,
                keep_global=case.reference_loss)
            reference, note = make_reference(case, pair)
            del pair
            return inputs, reference, note

        ok, value = stage(ranks, made, device, make)
        if not ok:
            case_result.note = f"inputs could not be made: {made.status}: {made.note}"
            log(f"[{case.key}] {case_result.note}")
            continue
        inputs, case_result.reference, reference_note = value
        del value
        case_result.note = reference_note
        common.release_memory(device)
        log(_case_header(case, case_result.reference, reference_note))
        for provider in providers:
            outcome = run_provider(provider, case, inputs, case_result.reference, ctx, settings)
            case_result.results[provider.key] = outcome
            progress = common.progress_line(outcome, _figures_text)
            log(f"  {case.key:<20} {outcome.label:<24} {progress}")
        cross_check(case_result)
        del inputs
        common.release_memory(device)
        if after_case is not None:
            after_case(case_results)
    return case_results


def _case_header(case: Case, reference: Reference | None, note: str) -> str:
    text = f"[{case.key}] clip {case.label}, logit_scale {case.logit_scale:.4g}: "
    if reference is None:
        return text + note
    return text + f"reference loss {reference.loss:.4f} ({reference.dtype})"


def _figures_text(result: ProviderResult) -> str:
    text = (f"{common.format_ms(result.ms)} ms, {common.format_mib(result.peak_extra_mib)} MB, "
            f"loss {result.loss:.5g}")
    if result.errors:
        text += ", " + ", ".join(f"{k} {v:.1e}" for k, v in result.errors.items())
    if result.compute_ms is not None:
        text += (f"; compute only {common.format_ms(result.compute_ms)} ms, transfers only "
                 f"{common.format_ms(result.comm_ms)} ms, overlap {_percent(result.overlap)}")
    elif result.overlap_note:
        text += f"; {result.overlap_note}"
    if result.graphed_ms is not None:
        text += f"; replayed as a CUDA graph {common.format_ms(result.graphed_ms)} ms"
    elif result.graphed_note:
        text += f"; {result.graphed_note}"
    return text


# ----------------------------------------------------------------------------- reports


@dataclass(kw_only=True)
class RunInfo(common.RunInfoBase):
    world: int
    dist_backend: str
    backend: str
    width: int
    batches: list[int]
    min_reps: int
    overlap: bool
    graph: bool = False


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _signed_ms(value: float | None) -> str:
    if value is None:
        return "—"
    return ("−" if value < 0 else "") + common.format_ms(abs(value))


def per_rank_text(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    return " / ".join(fmt(v) for v in values) if values else "—"


def errors_text(result: ProviderResult) -> str:
    if not result.errors:
        return "—"
    return ", ".join(f"{name} {value:.1e}" for name, value in result.errors.items())


def _check_text(result: ProviderResult) -> str:
    if result.loss_error is None:
        return result.check or "—"
    return f"{result.loss_error:.1e} ({result.check})"


def _comm_text(result: ProviderResult) -> tuple[str, str]:
    megabytes = "—" if result.comm_bytes is None else f"{result.comm_bytes / 2**20:.1f}"
    rate = result.comm_gbps
    return megabytes, "—" if rate is None else f"{rate:.1f}"


def render_markdown(info: RunInfo, case_results: Sequence[CaseResult]) -> str:
    env = info.environment
    units = (("GPU", "GPUs") if common.uses_cuda(env["device"])
             else ("CPU process", "CPU processes"))
    lines = [f"# Ring CLIP over {info.world} × {env['device_name']}, {env['date']}", ""]
    if info.quick:
        lines += [
            "> **--quick run**: tiny batches and short timing. A smoke test of the runner; the "
            "figures are not representative.",
            "",
        ]
    rows = [
        *common.environment_rows(env, info.peer_versions, f", backend {info.backend}"),
        ("ranks", f"K = {info.world} ({units[info.world > 1]}), torch.distributed backend "
                  f"{info.dist_backend}"),
        ("dtype, width, seed", f"{info.dtype}, c = {info.width}, seed {info.seed}"),
        common.matmul_row(info.matmul),
        ("timing", TIMING_DEFINITION + (
            f"; warmup {info.timing.warmup_ms:g} ms, rep {info.timing.rep_ms:g} ms, min_reps "
            f"{info.min_reps}" + ("" if common.uses_cuda(env["device"])
                                  else "; " + common.WALL_CLOCK_TIMING))),
        ("memory", RING_MEMORY_DEFINITION),
        ("overlap", OVERLAP_DEFINITION if info.overlap else "not measured (--no-overlap)"),
        ("CUDA graph", GRAPH_DEFINITION if info.graph else "not measured (without --graph)"),
        ("check", CHECK_DEFINITION),
        ("inputs", "one global batch B × c from benchmarks/inputs.py make_pair_features(B, c, "
                   "random, seed) (bf16 unit vectors), rank r holding pairs r·B/K … "
                   "(r+1)·B/K − 1: the same batch for every K; logit_scale a learnable fp32 "
                   "tensor, 1/0.07"),
        ("floor", "the one-pass cost floor (docs/design.md) of one rank's share: 8·b_r·B·c / R"),
    ]
    lines += [common.markdown_table(["setting", "value"], rows), ""]

    columns = common.provider_columns(case_results)
    lines += [
        "## Time and memory",
        "",
        "ms per forward+backward step (max over ranks of each rank's median) / peak MB per "
        "rank above inputs and gradient buffers (max over ranks); — = not run.",
        "",
    ]
    rows = []
    for cr in case_results:
        ours = cr.results.get(FUSEDLOSS)
        rows.append(
            [cr.case.label]
            + [common.time_and_memory_cell(cr.results.get(key), "—") for key, _ in columns]
            + [common.format_ratio(ours.times_floor) if ours else "—"]
        )
    headers = ["case (B×c (K×b_r) regime)"] + [label for _, label in columns]
    lines += [common.markdown_table(headers + ["fusedloss × floor"], rows), ""]

    overlap_rows = []
    for cr in case_results:
        ours = cr.results.get(FUSEDLOSS)
        if ours is None or not ours.measured:
            continue
        megabytes, rate = _comm_text(ours)
        overlap_rows.append([
            cr.case.label, common.format_ms(ours.ms), common.format_ms(ours.host_ms),
            common.format_ms(ours.graphed_ms), common.format_ms(ours.compute_ms),
            common.format_ms(ours.comm_ms), _signed_ms(ours.exposed_comm_ms),
            _percent(ours.overlap), megabytes, rate,
            "; ".join(n for n in (ours.overlap_note, ours.graphed_note) if n),
        ])
    if overlap_rows and (info.overlap or info.graph):
        lines += [
            "## Communication and compute (fusedloss)",
            "",
            "(a) ring step, (b) compute only, (c) transfers only, in ms (each the max over "
            "ranks of the rank's median); host: the host's time to issue one ring step that "
            f"starts on an idle GPU (median of {HOST_REPS} calls, max over ranks; where it is "
            "close to a, the host, not the GPU, sets the pace); graphed: the step replayed from "
            "a CUDA graph (with --graph); exposed = a − b; overlap "
            "= (b + c − a) / min(b, c) in [0, 1]; MB sent per rank per step and the transfers' "
            "rate c implies.",
            "",
        ]
        headers = ["case", "a: ring", "host", "graphed", "b: compute only", "c: transfers only",
                   "exposed a − b",
                   "overlap", "MB sent / rank", "GB/s", "note"]
        lines += [common.markdown_table(headers, overlap_rows), ""]

    lines += ["## Losses", "", "Mean over the ranks of their losses.", ""]
    rows = []
    for cr in case_results:
        reference = (f"{cr.reference.loss:.5f} ({cr.reference.dtype})" if cr.reference
                     else "— (none)")
        cells = []
        for key, _ in columns:
            result = cr.results.get(key)
            cells.append("—" if result is None or result.loss is None
                         else f"{result.loss:.5f}")
        rows.append([cr.case.label, reference, *cells])
    headers = ["case", "reference"] + [label for _, label in columns]
    lines += [common.markdown_table(headers, rows), ""]

    lines += ["## All figures", ""]
    rows = []
    for cr in case_results:
        for result in cr.results.values():
            rows.append([
                cr.case.key, result.label, result.status, common.format_ms(result.ms),
                per_rank_text(result.ms_per_rank, common.format_ms),
                "—" if result.reps is None else str(result.reps),
                common.format_mib(result.peak_extra_mib),
                per_rank_text(result.peak_per_rank, common.format_mib),
                common.format_ratio(result.times_floor),
                "—" if result.loss is None else f"{result.loss:.5f}",
                _check_text(result), errors_text(result),
                common.format_ms(result.first_call_ms), result.note,
            ])
    headers = ["case", "provider", "status", "ms", "ms per rank", "calls", "MB", "MB per rank",
               "× floor", "loss", "|loss − ref| (ref)", "gradient errors", "first call ms",
               "note"]
    lines += [common.markdown_table(headers, rows), ""]
    lines += common.closing_sections(info.calls, info.notes)
    return "\n".join(lines)


def results_json(info: RunInfo, case_results: Sequence[CaseResult]) -> dict[str, Any]:
    return {
        "suite": NAME,
        "environment": info.environment,
        "settings": {
            "world_size": info.world,
            "dist_backend": info.dist_backend,
            "dtype": info.dtype,
            "width": info.width,
            "batches": info.batches,
            "regimes": [REGIME],
            "seed": info.seed,
            "quick": info.quick,
            "warmup_ms": info.timing.warmup_ms,
            "rep_ms": info.timing.rep_ms,
            "min_reps": info.min_reps,
            "backend": info.backend,
            "providers": info.providers,
            "overlap": info.overlap,
            "graph": info.graph,
        },
        "matmul": info.matmul,
        "peer_versions": info.peer_versions,
        "definitions": {
            "timing": TIMING_DEFINITION,
            "memory": RING_MEMORY_DEFINITION,
            "overlap": OVERLAP_DEFINITION,
            "graph": GRAPH_DEFINITION,
            "check": CHECK_DEFINITION,
            "floor": "8·b_r·B·c / R per rank",
        },
        "cases": [
            {
                "case": cr.case.key,
                "global_batch": cr.case.batch,
                "per_rank_batch": cr.case.per_rank,
                "world_size": cr.case.world,
                "width": cr.case.width,
                "regime": cr.case.regime,
                "logit_scale": cr.case.logit_scale,
                "floor_ms": cr.case.floor_ms(info.matmul["tflops"]),
                "reference": None if cr.reference is None else {
                    "loss": cr.reference.loss, "dtype": cr.reference.dtype,
                    "directions": cr.reference.directions,
                },
                "note": cr.note,
                "results": [dict(asdict(r), comm_gbps=r.comm_gbps) for r in cr.results.values()],
            }
            for cr in case_results
        ],
        "calls": info.calls,
        "notes": info.notes,
    }


def short_tables(case_results: Sequence[CaseResult]) -> str:
    rows = []
    for cr in case_results:
        for result in cr.results.values():
            rows.append([
                *common.summary_cells(cr.case.key, result),
                _percent(result.overlap) if result.provider == FUSEDLOSS else "",
                _signed_ms(result.exposed_comm_ms) if result.provider == FUSEDLOSS else "",
                _check_text(result) if result.measured else "",
            ])
    headers = [*common.SUMMARY_HEADERS, "overlap", "exposed ms", "|loss − ref|"]
    return common.text_table(headers, rows)


# ----------------------------------------------------------------------------- process group


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


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batches",
        type=positive_int_list,
        default=None,
        help="comma list of global batches B, each split evenly over the K ranks (default "
        f"{','.join(map(str, DEFAULT_BATCHES))}; {','.join(map(str, QUICK_BATCHES))} with "
        "--quick)",
    )
    parser.add_argument(
        "--width", type=int, default=None,
        help=f"feature width c (default {DEFAULT_WIDTH}; {QUICK_WIDTH} with --quick)",
    )
    parser.add_argument(
        "--providers",
        type=common.comma_list(PROVIDER_KEYS),
        default=list(PROVIDER_KEYS),
        help=f"comma list of {', '.join(PROVIDER_KEYS)} (default: all)",
    )
    common.add_dtype_seed_arguments(parser)
    common.add_quick_device_timing_arguments(
        parser, "batches 256,512, c = 64, short timing: a smoke test that also runs on CPU "
        "(gloo)"
    )
    parser.add_argument(
        "--min-reps", type=int, default=DEFAULT_MIN_REPS,
        help=f"at least this many timed calls per figure (default {DEFAULT_MIN_REPS})",
    )
    parser.add_argument(
        "--no-overlap", action="store_true",
        help="skip fusedloss's compute-only and transfers-only measurements",
    )
    parser.add_argument(
        "--graph", action="store_true",
        help="also time fusedloss's step replayed from a CUDA graph (CUDA only)",
    )
    common.add_matmul_output_arguments(parser)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    return run_distributed(args, "ring", _run, log)


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
    # gloo can abort (SIGABRT) at interpreter exit after point-to-point transfers: such a
    # process leaves, once the group is destroyed, without running the C++ destructors.
    hard_exit = created and dist_backend == "gloo" and dist.get_world_size() > 1
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


def _run(args: argparse.Namespace, ctx: Context) -> int:
    ranks, say = ctx.ranks, ctx.say
    batches = args.batches or list(QUICK_BATCHES if ctx.quick else DEFAULT_BATCHES)
    width = args.width or (QUICK_WIDTH if ctx.quick else DEFAULT_WIDTH)
    try:
        cases = select_cases(batches, width, ranks.world)
    except ValueError as error:
        say(str(error))
        return 2
    settings = Settings(overlap=not args.no_overlap, graph=args.graph)
    all_providers = ring_providers(ctx.backend)
    providers = [all_providers[key] for key in args.providers]
    env = ctx.environment
    if ranks.rank == 0:
        say(f"ring on {ranks.world} × {env['device_name']} ({ctx.dist_backend}): torch "
            f"{env['torch']}, triton {env['triton']}, {common.dtype_name(ctx.dtype)}, "
            f"c = {width}, fusedloss backend {ctx.backend}, cases: "
            f"{', '.join(case.key for case in cases)}")
    matmul = ctx.probe_matmul(args.matmul_size)

    def summary(results: Sequence[CaseResult]) -> RunInfo:
        return info_of(args, results, ctx, matmul, settings, batches, width)

    def write_so_far(results: list[CaseResult]) -> None:
        if ranks.rank == 0:
            write_report_files(args, summary(results), results)

    case_results = run_cases(cases, providers, ctx, settings, say, write_so_far)
    try:
        if ranks.rank == 0:
            report(args, summary(case_results), case_results, say)
    finally:
        ranks.barrier()  # every rank leaves once the results are written
    return 0


def info_of(args: argparse.Namespace, case_results: Sequence[CaseResult], ctx: Context,
            matmul: dict[str, Any], settings: Settings, batches: Sequence[int],
            width: int) -> RunInfo:
    """Rank 0's summary of the run: floors, the calls measured, the notes."""
    calls, notes = collect_calls_notes(case_results, ctx.notes)
    for cr in case_results:
        for result in cr.results.values():
            result.times_floor = (result.ms / cr.case.floor_ms(matmul["tflops"])
                                  if result.measured else None)
    return RunInfo(
        environment=ctx.environment, matmul=matmul, dtype=common.dtype_name(ctx.dtype),
        seed=ctx.seed, quick=ctx.quick, timing=ctx.timing, providers=list(args.providers),
        peer_versions={name: common.package_version(name)
                       for name in ("inf-cl", "open-clip-torch")},
        calls=calls, notes=notes, world=ctx.ranks.world, dist_backend=ctx.dist_backend,
        backend=ctx.backend, width=width, batches=list(batches), min_reps=ctx.min_reps,
        overlap=settings.overlap, graph=settings.graph,
    )


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


def write_report_files(args: argparse.Namespace, info: RunInfo,
                       case_results: Sequence[CaseResult]) -> tuple[Path, Path]:
    """The results files ``ring_<date>_<gpu>_<K>gpu[_tag].md/.json`` of the cases so far."""
    env = info.environment
    stem = results_stem(env["date"], env["device_slug"], info.world,
                        common.uses_cuda(env["device"]), args.tag)
    return common.write_results(
        args.out, stem, render_markdown(info, case_results), results_json(info, case_results))


def report(args: argparse.Namespace, info: RunInfo, case_results: Sequence[CaseResult],
           log: Callable[[str], None]) -> None:
    """Writes the results files (rank 0), then logs the notes, the paths and a short table."""
    md_path, json_path = write_report_files(args, info, case_results)
    log("")
    for note in info.notes:
        log(f"note: {note}")
    log(f"results: {md_path}")
    log(f"         {json_path}")
    log("")
    log(short_tables(case_results))


SUITE = Suite(
    name=NAME,
    help="CLIP over K processes (torchrun): fusedloss's ring against inf-cl and open_clip, "
    "with the ring's communication overlap",
    add_arguments=add_arguments,
    run=run,
)
