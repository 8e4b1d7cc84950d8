"""Suite ``ring``: CLIP or SigLIP over K processes (torchrun), fusedloss's ring against inf-cl
and open_clip;
and the frame every torchrun suite shares (process group, collectives agreed across the ranks,
timing, the report rank 0 writes). benchmarks/README.md defines the figures."""

from __future__ import annotations

import argparse
import datetime
import functools
import gzip
import math
import os
import shutil
import statistics
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks import common
from benchmarks.common import OUT_OF_MEMORY, column, format_ms
from benchmarks.inputs import make_pair_features, pair_logit_scale
from benchmarks.providers import Unavailable, inf_cl_head_dim, inf_clip_loss
from benchmarks.suites import Suite, contrastive

FUSEDLOSS, INF_CL, OPEN_CLIP = "fusedloss", "inf-cl", "open-clip"
LOSSES = (contrastive.CLIP, contrastive.SIGLIP)
# The products a step needs, 2·b_r·B·c multiply-adds each: CLIP's forward, its recompute, dI,
# dT; SigLIP's logits, dI, dT.
PRODUCTS = {contrastive.CLIP: 4, contrastive.SIGLIP: 3}
PROVIDER_KEYS = (FUSEDLOSS, INF_CL, OPEN_CLIP)
PEERS = {INF_CL: "inf-cl", OPEN_CLIP: "open-clip-torch"}  # their distributions
DEFAULT_BATCHES = (65_536, 131_072, 262_144, 524_288, 1_048_576)
QUICK_BATCHES = (256, 512)
DEFAULT_WIDTH, QUICK_WIDTH = 512, 64
REGIME = "random"  # make_pair_features' regime
MIN_REPS, MAX_REPS, MAX_WARMUP = 3, 1000, 100  # timed and warm-up calls
HOST_REPS = 5  # synchronized calls whose host (issue) time is measured
GRAPH_WARMUP_CALLS = 2
GROUP_TIMEOUT_S = 1800.0
CPU = torch.device("cpu")
RING_SHIFT = "fusedloss.distributed.ring.Shift"  # the ring's transfers go through it


# ============================================================================ the shared frame
@dataclass
class Context:
    """This process in the default group (world 1: alone); every method is a collective."""

    rank: int
    world: int
    device: torch.device
    backend: str  # fusedloss's: triton on CUDA, torch on the CPU
    dtype: torch.dtype
    timing: common.TimingSettings
    environment: dict[str, Any]  # rank 0's; {} on the others
    say: Callable[[str], None]  # rank 0's log; silent on the others

    def gather(self, value: Any) -> list[Any]:
        out = [value] * self.world
        if self.world > 1:
            dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        """All ranks here, with their device work done."""
        common.synchronize(self.device)
        self.gather(None)

    def stage(self, row: dict[str, Any], action: Callable[[], Any]) -> tuple[bool, Any]:
        return common.stage(row, action, self.device, self.gather)

    def relative_error(self, actual: Tensor, reference: Tensor) -> float:
        """‖a − ref‖₂ / ‖ref‖₂ of a tensor split over the ranks."""
        a, r = actual.double(), reference.double()
        diff = math.fsum(self.gather(float(((a - r) ** 2).sum())))
        return math.sqrt(diff / math.fsum(self.gather(float((r**2).sum()))))


def time_on_all_ranks(fn: Callable[[], Any], ctx: Context, min_reps: int,
                      host: bool = False) -> dict[str, Any]:
    """Each rank's median ms of ``fn()`` over the same number of calls on every rank (with
    ``host`` also the time to issue one on an idle GPU); ``ms``: the max over the ranks."""
    device, timing = ctx.device, ctx.timing
    estimate = max(max(ctx.gather(common.call_ms(fn, device))), 1e-3)
    for _ in range(min(MAX_WARMUP, int(timing.warmup_ms / estimate))):
        fn()
    reps = max(min_reps, min(MAX_REPS, int(timing.rep_ms / estimate)))
    ctx.barrier()
    if common.uses_cuda(device):
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) for start, end in events]
    else:
        samples = [common.timed(fn, device)[0] for _ in range(reps)]
    per_rank = ctx.gather(statistics.median(samples))
    figures = {"ms": max(per_rank), "ms_per_rank": per_rank, "reps": reps}
    if host:
        issue = []
        for _ in range(HOST_REPS):
            ctx.barrier()
            issue.append(common.timed(fn, CPU)[0])  # the wall clock, no synchronization
        figures["host_per_rank"] = ctx.gather(statistics.median(issue))
        figures["host_ms"] = max(figures["host_per_rank"])
        common.synchronize(device)
    return figures


def measure_provider(row: dict[str, Any], ctx: Context, loss_fn: Callable[[], Tensor],
                     leaves: Sequence[Tensor], check: Callable[[Tensor, Sequence[Tensor]], Any],
                     min_reps: int, host: bool = False) -> Callable[[], Any] | None:
    """``common.check_and_time`` on every rank (the first call's forward and backward each
    agreed, then ``check``); the timed step, None after a failure."""

    def first_call() -> list[str] | None:
        ok, loss = ctx.stage(row, loss_fn)
        if ok:
            ok, grads = ctx.stage(row, lambda: torch.autograd.grad(loss, leaves))
        if not ok:
            return None
        row["rank_losses"] = ctx.gather(float(loss.detach().float()))
        finite = all(ctx.gather(all(bool(torch.isfinite(t).all()) for t in (loss, *grads))))
        return check(loss, grads) + ([] if finite else ["not finite (on some rank)"])

    def step() -> tuple[Tensor, ...]:
        return torch.autograd.grad(loss_fn(), leaves)

    common.release_memory(ctx.device)
    ok = common.check_and_time(row, ctx.device, first_call, step, common.tensor_bytes(leaves),
                               lambda fn, _: time_on_all_ranks(fn, ctx, min_reps, host),
                               ctx.gather)
    return step if ok else None


def say_row(ctx: Context, row: dict[str, Any]) -> None:
    ctx.say(f"  {row['label']:<26} {row['status']}: {format_ms(row['ms'])} ms, "
            f"{common.format_mib(row.get('peak_extra_mib'))} MB, {common.errors_text(row)} "
            f"{row['note']}")


RESULT_COLUMNS: list[common.Column] = [  # items: rows with their case's key under "case"
    column("case", "case"), column("provider", "label"), column("status", "status"),
    column("ms", "ms", format_ms), column("MB", "peak_extra_mib", common.format_mib),
    column("× floor", "times_floor", common.format_ratio),
    ("|loss − ref|", lambda r: r.get("check") or "—" if r.get("loss_error") is None
     else f"{r['loss_error']:.1e} ({r['check']})"),
    ("gradient errors", common.errors_text), column("loss", "loss", "{:.5f}".format),
    column("note", "note"),
]


def result_items(cases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**row, "case": case["case"]} for case in cases for row in case["results"]]


def write_report(args: argparse.Namespace, ctx: Context, title: str, body: list[str],
                 payload: dict[str, Any], summary: str, log: bool = True) -> None:
    """Rank 0: a torchrun suite's results files (its settings: ``args``), ``summary`` logged."""
    env, world = ctx.environment, ctx.world
    settings = {"world_size": world, "dist_backend": dist.get_backend(), "backend": ctx.backend,
                **{k: v for k, v in vars(args).items() if k != "out"},
                "warmup_ms": ctx.timing.warmup_ms, "rep_ms": ctx.timing.rep_ms}
    notes = [common.QUICK_NOTE] if args.quick else []
    for case in payload.get("cases", []):
        notes += [f"{case['case']}: {case['note']}"] if case["note"] else []
        for row in case["results"]:
            common.note_problem(notes, case["case"], row)
    versions = {peer: common.package_version(peer) for peer in PEERS.values()}
    rows = [*common.environment_rows(env, versions if args.suite == "ring" else {}),
            *[(k, v) for k, v in settings.items() if v is not None],
            *([common.matmul_row(payload["matmul"])] if "matmul" in payload else []),
            ("timing", "CUDA events" if common.uses_cuda(ctx.device) else common.WALL_CLOCK_TIMING),
            ("definitions", f"benchmarks/README.md, the `{args.suite}` suite")]
    payload = {"suite": args.suite, "environment": env, "settings": settings, **payload,
               "notes": notes}
    common.write_report(args.out, args.suite.replace("-", "_"), args.tag, env, title, rows, body,
                        payload, summary, notes=notes, world=world,
                        log=ctx.say if log else lambda _line: None)


def run_distributed(args: argparse.Namespace, body: Callable[[argparse.Namespace, Context], int],
                    log: Callable[[str], None] = print) -> int:
    """``body(args, context)`` in the process group (NCCL, or gloo on a CPU; one process without
    torchrun)."""
    device = common.run_device(args, args.suite, log)
    if device is None:
        return 2
    cuda = device.type == "cuda"
    options: dict[str, Any] = {"timeout": datetime.timedelta(seconds=GROUP_TIMEOUT_S)}
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", device.index or 0)))
        torch.cuda.set_device(device)
        options["device_id"] = device
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "0"}.items():  # one process without torchrun
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl" if cuda else "gloo", **options)
    rank = dist.get_rank()
    ctx = Context(rank, dist.get_world_size(), device, "triton" if cuda else "torch",
                  common.DTYPES[args.dtype],
                  common.timing_settings(args.warmup_ms, args.rep_ms, args.quick),
                  common.collect_environment(device) if rank == 0 else {},
                  log if rank == 0 else lambda _text: None)
    try:
        code = body(args, ctx)
    finally:
        dist.destroy_process_group()
    if not cuda:  # gloo can abort at interpreter exit: leave without the C++ destructors
        sys.stdout.flush()
        os._exit(code)
    return code


# ============================================================================ the ring suite
def overlap_fraction(ring_ms: float, compute_ms: float, comm_ms: float) -> float | None:
    """(b + c − a) / min(b, c) clamped to [0, 1]; None where it is undefined."""
    shorter = min(compute_ms, comm_ms)
    if not all(map(math.isfinite, (ring_ms, compute_ms, comm_ms))) or shorter <= 0:
        return None
    return min(1.0, max(0.0, (compute_ms + comm_ms - ring_ms) / shorter))


class ShiftRecording:
    """One ring step's shifts (layout, send (shape, dtype)s, what it received, tag) and the order
    of their posts and waits: made into a compute-only and a transfers-only step."""

    def __init__(self, step: Callable[[], Any]):
        from fusedloss.distributed.ring import Shift
        self.shifts: list[tuple[Any, list[tuple[Any, torch.dtype]], list[Tensor], int]] = []
        self.events: list[tuple[str, int]] = []  # ("post" | "wait", shift index)
        self.step, self.cursor, recording = step, 0, self

        class RecordingShift(Shift):
            def __init__(self, layout: Any, send: list[Tensor], recv: list[Tensor], tag=0):
                self.index = len(recording.shifts)
                send_specs = [(t.shape, t.dtype) for t in send]
                recording.shifts.append((layout, send_specs, list(recv), tag))
                recording.events.append(("post", self.index))
                super().__init__(layout, send, recv, tag=tag)

            def wait(self) -> None:
                recording.events.append(("wait", self.index))
                super().wait()

        with mock.patch(RING_SHIFT, RecordingShift):
            step()

    def bytes_sent(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize
                   for _, send, _, _ in self.shifts for shape, dtype in send)

    def compute_only(self) -> Any:
        """The step with each ``Shift`` a copy of what it received into the receive buffers."""
        recording = self

        class ReplayedShift:
            def __init__(self, layout: Any, send: list[Tensor], recv: list[Tensor], tag=0):
                received = recording.shifts[recording.cursor][2]
                recording.cursor += 1
                for buffer, tensor in zip(recv, received, strict=True):
                    buffer.copy_(tensor)

            def wait(self) -> None:
                return None

        self.cursor = 0
        with mock.patch(RING_SHIFT, ReplayedShift):
            out = self.step()
        if self.cursor != len(self.shifts):
            raise RuntimeError(f"the ring made {self.cursor} transfers, the recording "
                               f"{len(self.shifts)}")
        return out

    def transfers_only(self, device: torch.device) -> Callable[[], None]:
        """The recorded shifts alone, in the recorded order, between zero-filled buffers (one
        per receive tag: shifts in flight together have different tags)."""
        from fusedloss.distributed.ring import Shift

        @functools.cache
        def buffer(shape: torch.Size, dtype: torch.dtype, key: Any) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        plan = [(layout, [buffer(shape, dtype, "send") for shape, dtype in send],
                 [buffer(t.shape, t.dtype, tag + i) for i, t in enumerate(recv)], tag)
                for layout, send, recv, tag in self.shifts]
        events = list(self.events)

        def run() -> None:
            posted = {}
            for kind, index in events:
                if kind == "post":
                    layout, send, recv, tag = plan[index]
                    posted[index] = Shift(layout, send, recv, tag=tag)
                else:
                    posted.pop(index).wait()
            for shift in posted.values():
                shift.wait()

        return run


def time_variant(row: dict[str, Any], name: str, make: Callable[[], Callable[[], Any]],
                 ctx: Context, min_reps: int) -> bool:
    """``make()``'s function timed like the step, into ``row[name + "_ms"]`` (and
    ``_per_rank``), or why not into ``row[name + "_note"]``."""
    probe: dict[str, Any] = {}
    ok, fn = ctx.stage(probe, make)
    if ok:
        ok, timed = ctx.stage(probe, lambda: time_on_all_ranks(fn, ctx, min_reps))
    fn = None
    common.release_memory(ctx.device)
    if ok:
        row[f"{name}_ms"], row[f"{name}_per_rank"] = timed["ms"], timed["ms_per_rank"]
    else:
        row[f"{name}_note"] = f"{name} not measured: {probe['status']}: {probe['note']}"
    return ok


def measure_overlap(row: dict[str, Any], step: Callable[[], Any], ctx: Context,
                    min_reps: int) -> None:
    """(b) compute only and (c) transfers only, made from one recorded step."""
    recordings: list[ShiftRecording] = []

    def compute_only() -> Callable[[], Any]:
        recordings.append(ShiftRecording(step))
        return recordings[0].compute_only

    if not time_variant(row, "compute", compute_only, ctx, min_reps):
        return
    row["exposed_comm_ms"] = row["ms"] - row["compute_ms"]
    row["comm_bytes"] = max(ctx.gather(recordings[0].bytes_sent()))
    row["comm_ms"] = row["overlap"] = None
    if not recordings[0].shifts:
        row["comm_note"] = f"K = {ctx.world}: the ring makes no transfers"
    # pop: the transfers need the shapes only, not the received tensors
    elif time_variant(row, "comm", lambda: recordings.pop().transfers_only(ctx.device), ctx,
                      min_reps):
        row["overlap"] = overlap_fraction(row["ms"], row["compute_ms"], row["comm_ms"])


def graphed_step(step: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """The replay of the step captured once in a CUDA graph (checked bit for bit)."""
    if not common.uses_cuda(device):
        raise Unavailable("CUDA graphs need a CUDA device")
    graph, captured = common.capture_graph(step, device, GRAPH_WARMUP_CALLS)
    graph.replay()
    if not all(torch.equal(c, e) for c, e in zip(captured, step(), strict=True)):
        raise RuntimeError("a replay's gradients differ from an eager call's")
    return graph.replay


def build_loss(key: str, ctx: Context, width: int, loss: str) -> Callable[..., Tensor]:
    """This rank's loss(image_r, text_r, logit_scale[, logit_bias]); the mean over the ranks is
    the global one."""
    if loss == contrastive.SIGLIP:
        return _build_siglip(key, ctx)
    if key == FUSEDLOSS:
        from fusedloss.distributed import clip_loss
        return lambda image, text, scale: clip_loss(image, text, scale, backend=ctx.backend)
    if key == INF_CL:
        from inf_cl import cal_inf_loss
        if not common.uses_cuda(ctx.device):
            raise Unavailable("inf-cl's Triton kernels (inline PTX) need a CUDA device")
        inf_cl_head_dim(width)  # raises Unavailable for a width it cannot take
        return inf_clip_loss(cal_inf_loss)
    from open_clip.loss import ClipLoss
    # torch ≥ 2.7 deprecates torch.distributed.nn.all_gather, which open_clip calls.
    warnings.filterwarnings("ignore", message=r".*all_gather is deprecated",
                            category=FutureWarning)
    return ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True,
                    rank=ctx.rank, world_size=ctx.world)


def _build_siglip(key: str, ctx: Context) -> Callable[..., Tensor]:
    if key == FUSEDLOSS:
        from fusedloss.distributed import siglip_loss
        return lambda image, text, scale, bias: siglip_loss(image, text, scale, bias,
                                                            backend=ctx.backend)
    if key == INF_CL:
        raise Unavailable("inf-cl has no sigmoid loss")
    from open_clip.loss import SigLipLoss
    # its neighbour exchange: each rank's value Σ / b_r, gradients through the exchanged texts
    return SigLipLoss(rank=ctx.rank, world_size=ctx.world)


def check_pair(row: dict[str, Any], ctx: Context, rows: slice, grads: Sequence[Tensor],
               reference: Any) -> list[str]:
    """The ranks' mean loss and their gradients ÷ K against the reference; collectives."""
    row["loss"] = math.fsum(row["rank_losses"]) / ctx.world
    row["check"] = "finite" if reference is None else reference.dtype
    if reference is None:
        return []
    row["loss_error"], problems = common.check_loss(row["loss"], reference.loss,
                                                    contrastive.LOSS_TOLERANCE)
    if reference.grads is None:
        return problems
    row["errors"] = {name: ctx.relative_error(g.double() / ctx.world, reference.grads[name][rows])
                     for name, g in zip(("dI", "dT"), grads[:2], strict=True)}
    for name, grad in zip(("ds", "db"), grads[2:], strict=False):  # SigLIP: and d logit_bias
        value = float(grad)  # inf-cl all-reduces d logit_scale itself
        total = value if row["provider"] == INF_CL else math.fsum(ctx.gather(value))
        want = float(reference.grads[name])
        row["errors"][name] = abs(total / ctx.world - want) / abs(want)
    return problems + common.bound_problems(row["errors"], lambda name: (
        contrastive.SCALAR_ERROR_BOUND if name in ("ds", "db") else
        contrastive.GRADIENT_ERROR_BOUND))


def run_provider(key: str, case: dict[str, Any], leaves: tuple[Tensor, ...], rows: slice,
                 reference: Any, ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    """One provider on one case, on every rank; a failure on any rank is the row's status."""
    device = ctx.device
    version = common.package_version(PEERS[key]) if key in PEERS else None
    row = common.new_row(key, f"{key} {version}" if version else key)
    ok, loss_fn = ctx.stage(row, lambda: build_loss(key, ctx, args.width, args.loss))
    if not ok:
        return row
    # open_clip's two b_r × B log-softmax outputs, predicted: a rank that ran out of memory
    # alone would leave the others waiting in a collective.
    needed = 2 * case["per_rank_batch"] * case["global_batch"] * leaves[0].itemsize
    if key == OPEN_CLIP and args.loss == contrastive.CLIP and common.uses_cuda(device):
        common.release_memory(device)
        free = min(ctx.gather(torch.cuda.mem_get_info(device)[0]))
        if needed > free:
            row["status"] = OUT_OF_MEMORY
            row["note"] = f"not run: needs ≥ {needed / 2**30:.1f} GiB, {free / 2**30:.1f} free"
            return row
    step = measure_provider(row, ctx, lambda: loss_fn(*leaves), leaves,
                            lambda loss, grads: check_pair(row, ctx, rows, grads, reference),
                            args.min_reps, host=key == FUSEDLOSS)
    if step is not None and key == FUSEDLOSS and not args.no_overlap:
        measure_overlap(row, step, ctx, args.min_reps)
    if step is not None and key == FUSEDLOSS and args.graph:
        time_variant(row, "graphed", lambda: graphed_step(step, device), ctx, args.min_reps)
    if step is not None and key == FUSEDLOSS and args.trace:
        stem = Path(args.out) / f"ring_trace_b{case['global_batch']}"
        row["trace"] = write_trace(step, ctx, stem)
    return row


TRACE_STEPS = 3


def write_trace(step: Callable[[], Any], ctx: Context, stem: Path) -> str:
    """Each rank's profiler trace of TRACE_STEPS steps (host and, on CUDA, kernels and NCCL
    transfers) as ``<stem>_rank<r>.json.gz`` (chrome://tracing, Perfetto): where the ring's
    transfers overlap its compute and where they wait. Returns this rank's file name."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if common.uses_cuda(ctx.device):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ctx.barrier()
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(TRACE_STEPS):
            step()
        common.synchronize(ctx.device)
    path = stem.with_name(f"{stem.name}_rank{ctx.rank}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))
    with path.open("rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    path.unlink()
    ctx.barrier()
    return f"{path.name}.gz"


def run_case(batch: int, ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    """Every provider on one global batch (without a reference, the peers against fusedloss's
    loss); the case as the JSON keeps it."""
    per_rank = batch // ctx.world
    case = {"case": f"{batch}×{args.width} ({ctx.world}×{per_rank})", "global_batch": batch,
            "per_rank_batch": per_rank, "reference": None, "note": "", "results": []}
    rows = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    ok, features = ctx.stage(case, lambda: make_pair_features(
        batch, args.width, REGIME, dtype=ctx.dtype, device=ctx.device, seed=args.seed))
    if not ok:
        case["note"] = f"inputs could not be made: {case.pop('status')}: {case['note']}"
        return case
    # SigLIP at its initialization (scale 10, bias −10), CLIP at the regime's scale
    values = ((contrastive.SIGLIP_LOGIT_SCALE, contrastive.SIGLIP_LOGIT_BIAS)
              if args.loss == contrastive.SIGLIP else (pair_logit_scale(REGIME),))
    leaves = (*(f[rows].clone().requires_grad_(True) for f in features),
              *(torch.tensor(v, dtype=torch.float32, device=ctx.device, requires_grad=True)
                for v in values))
    # The global batch's reference: float64 with gradients while B²·c ≤ 2^40, else a float32
    # loss up to 262,144 pairs, else fusedloss's loss for the peers.
    grads = batch**2 * args.width <= contrastive.REFERENCE_GRADS_MAX_WORK
    reference = None
    if batch <= contrastive.REFERENCE_LOSS_MAX_ROWS:
        ok, reference = ctx.stage(case, lambda: contrastive.contrastive_reference(
            args.loss, (*features, *values), with_grads=grads,
            dtype=torch.float64 if grads else torch.float32))
        case["reference"] = {"loss": reference.loss, "dtype": reference.dtype} if ok else None
        case["note"] = "" if ok else f"no reference: {case.pop('status')}: {case['note']}"
    features = None
    ctx.say(f"[{case['case']}] reference {case['reference']}")
    for key in sorted(args.providers, key=PROVIDER_KEYS.index):  # fusedloss first
        case["results"].append(run_provider(key, case, leaves, rows, reference, ctx, args))
        row = case["results"][-1]
        say_row(ctx, row)
        if reference is None and key == FUSEDLOSS and common.measured(row):
            reference = SimpleNamespace(loss=row["loss"], dtype="fusedloss", grads=None)
    leaves = reference = None
    common.release_memory(ctx.device)
    return case


OVERLAP_COLUMNS: list[common.Column] = [  # fusedloss's (a), host, graph, (b), (c)
    column("case", "case"), column("a: ring", "ms", format_ms),
    column("host", "host_ms", format_ms), column("graphed", "graphed_ms", format_ms),
    column("b: compute only", "compute_ms", format_ms),
    column("c: transfers only", "comm_ms", format_ms),
    column("exposed a − b", "exposed_comm_ms", format_ms),
    column("overlap %", "overlap", lambda share: f"{100 * share:.0f}"),
    column("MB sent / rank", "comm_bytes", lambda sent: f"{sent / 2**20:.1f}" if sent else "—"),
    ("note", lambda r: "; ".join(r[k] for k in ("compute_note", "comm_note", "graphed_note")
                                 if k in r)),
]


def _run(args: argparse.Namespace, ctx: Context) -> int:
    args.batches = args.batches or list(QUICK_BATCHES if args.quick else DEFAULT_BATCHES)
    args.width = args.width or (QUICK_WIDTH if args.quick else DEFAULT_WIDTH)
    if any(batch % ctx.world for batch in args.batches):
        ctx.say(f"global batches {args.batches} must split evenly over {ctx.world} ranks")
        return 2
    matmul = common.probe_matmul(ctx.device, args.quick, ctx.timing, ctx.dtype,
                                 ctx.say) if ctx.rank == 0 else {}
    cases = []
    for batch in args.batches:
        cases.append(run_case(batch, ctx, args))
        if ctx.rank != 0:
            continue
        # One rank's share of the products' floor, 2·P·b_r·B·c / R (P products).
        cases[-1]["floor_ms"] = (2.0 * PRODUCTS[args.loss] * batch**2 / ctx.world * args.width
                                 / matmul["tflops"] / 1e9)
        for row in cases[-1]["results"]:
            row["times_floor"] = (row["ms"] / cases[-1]["floor_ms"] if common.measured(row)
                                  else None)
        items = result_items(cases)
        ours = [r for r in items if r["provider"] == FUSEDLOSS and common.measured(r)]
        body = common.section("Results", "ms: forward+backward step, max over the ranks of each "
                              "rank's median; MB: peak per rank above inputs and gradients, max "
                              "over the ranks; loss: mean over the ctx.", RESULT_COLUMNS, items)
        if ours and (not args.no_overlap or args.graph):
            body += common.section("Communication and compute (fusedloss)", "ms, max over the "
                                   "ranks; host: the time to issue one step started on an idle "
                                   "GPU.", OVERLAP_COLUMNS, ours)
        # Rewritten after each case: a run stopped midway keeps its finished cases.
        write_report(args, ctx, f"Ring {'SigLIP' if args.loss == contrastive.SIGLIP else 'CLIP'}",
                     body, {"matmul": matmul, "cases": cases},
                     common.table(RESULT_COLUMNS[:7], items, text=True),
                     log=batch == args.batches[-1])
    ctx.barrier()  # every rank leaves once the results are written
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--batches", type=common.int_list, default=None,
        help=f"comma list of global batches B (default {','.join(map(str, DEFAULT_BATCHES))})")
    add("--width", type=int, default=None, help=f"c (default {DEFAULT_WIDTH})")
    add("--loss", choices=LOSSES, default=contrastive.CLIP,
        help="clip (default) or siglip (scale 10, bias −10; inf-cl has none)")
    common.add_list(parser, "--providers", PROVIDER_KEYS, PROVIDER_KEYS)
    common.add_common_arguments(parser, "B 256,512, c = 64: a smoke test (gloo)")
    add("--min-reps", type=int, default=MIN_REPS,
        help=f"at least this many timed calls (default {MIN_REPS})")
    add("--no-overlap", action="store_true",
        help="skip fusedloss's compute-only and transfers-only measurements")
    add("--graph", action="store_true",
        help="also time fusedloss's step replayed from a CUDA graph (CUDA only)")
    add("--trace", action="store_true",
        help=f"also write each rank's profiler trace of {TRACE_STEPS} fusedloss steps to --out "
             "(ring_trace_b<B>_rank<r>.json.gz)")


SUITE = Suite("ring", "CLIP or SigLIP over K processes (torchrun): fusedloss's ring against "
              "inf-cl and open_clip", add_arguments, lambda args: run_distributed(args, _run))
