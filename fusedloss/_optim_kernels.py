"""Fused step of StableAdamW: one Triton launch updates every tensor of a (param group, device).

The clipped update needs each tensor's RMS_t = sqrt(mean(g² / max(û_t, ε²))) with the *updated*
second moment before any element of that tensor may move, so every element is visited twice:

- pass 1 (one program per chunk of BLOCK elements): u = β2 u + (1-β2) g² in registers, the chunk's
  Σ (g / max(sqrt(û), ε))² into a partials buffer. It reads g and u and writes nothing else;
- pass 2 (one program per chunk): the tensor's RMS_t, then m, u and θ from p, g, m, u.

Bytes per element in fp32: pass 1 reads 8, pass 2 reads 16 and writes 12, 36 in all against fused
AdamW's 28 (read p, g, m, v; write p, m, v). Writing m and u in pass 1 instead (reads g, m, u,
writes m, u; then pass 2 reads p, m, u, writes p) also moves 36, but pass 1 would then move 20 bytes
per element instead of 8. What pass 2 re-reads of g and u comes from L2 rather than DRAM when not
much traffic passed in between, and that is the whole margin over two plain passes (36 → 28 at
best): so pass 1 is kept small, its loads ask L2 to keep the lines (``evict_last``), pass 2's
streams ask to go first, and pass 2 follows pass 1 tensor by tensor inside one launch rather than
in a second launch after every tensor's pass 1 (with 86 M parameters the data of one pass is
~690 MB, far beyond a 50 MB L2).

Order inside one launch. Each program takes a ticket from an atomic counter and runs the work item
of that rank in a schedule built on the host (:func:`work_schedule`): pass-1 items of the tensors
in order, each tensor's pass-2 items ``lag`` pass-1 items after its last pass-1 item, in reverse
chunk order (the most recently read data first). A pass-2 program waits (spins) until its tensor's
pass 1 is complete. Tickets make that wait safe: a program holding ticket w knows that every item
ranked before w is held by a program that already runs, and pass-1 programs never wait, so the
awaited programs finish whatever the hardware's block order. The lag lets those programs finish
before their pass 2 is handed out (few or no programs spin); a larger lag costs L2 reuse.

Reduction per tensor, deterministic without float atomics: the pass-1 program that arrives last
at its tensor's integer counter sums the tensor's partials in a fixed order, computes RMS_t, the
learning-rate factor and the bias corrections, writes the tensor's ``step`` and ``rms`` state and
three per-tensor scalars, then bumps the counter once more; pass-2 programs wait for that value.
Writes that other programs read in the same launch (partials, scalars) go through integer atomics
of the program's one atomic thread, followed by the counter's release; readers spin on volatile
loads, acquire with an atomic, and read with volatile loads (bypassing the non-coherent L1).

Arithmetic mirrors ``StableAdamW``'s foreach path operation by operation (correctly rounded
division and square root, the same fp32 constants), so the two agree to fp32 rounding (the norm's
summation order and contractions into fma differ). Under Triton's interpreter, programs run one
after another in ticket order, so every wait is already satisfied.

Tensors: float32 parameters, gradients and moments, each walked as one flat array (the host checks
the layouts), on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import math
import struct
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from torch import Tensor

from .core import config

# Columns of the per-tensor table (int64): addresses, then sizes.
_COLUMNS = tl.constexpr(10)
_PARAM = tl.constexpr(0)
_GRAD = tl.constexpr(1)
_EXP_AVG = tl.constexpr(2)
_EXP_AVG_SQ = tl.constexpr(3)
_STEP = tl.constexpr(4)  # 0-d float32 step count
_RMS = tl.constexpr(5)  # 0-d float32 last RMS_t (0 without track_rms)
_NUMEL = tl.constexpr(6)
_FIRST_CHUNK = tl.constexpr(7)
_CHUNKS = tl.constexpr(8)
_INV_SQRT_NUMEL = tl.constexpr(9)  # float32 bits of 1 / sqrt(max(numel, 1))
# Per-tensor scalars that the last pass-1 program hands to pass 2 (float32 bits).
_SCALARS = tl.constexpr(4)
_BIAS2 = tl.constexpr(0)  # sqrt(1 - β2^t)
_STEP_SIZE = tl.constexpr(1)  # -η_t / (1 - β1^t)
_SHRINK = tl.constexpr(2)  # weight-decay factor of θ

# How the weight-decay factor is formed, as the foreach path forms it.
DECAY_NONE, DECAY_CONSTANT, DECAY_LR, DECAY_CLIPPED = 0, 1, 2, 3


@dataclass(frozen=True)
class FusedConfig:
    """Launch shape: ``block`` elements per program, ``reduce_block`` partials per load,
    ``lag`` pass-1 items between a tensor's last pass-1 item and its pass-2 items."""

    block: int
    reduce_block: int
    num_warps: int
    lag: int


# Small chunks under the interpreter, so that tiny test tensors span several programs.
INTERPRETER_CONFIG = FusedConfig(block=8, reduce_block=4, num_warps=1, lag=1)


def fused_config(device: torch.device) -> FusedConfig:
    """Frozen per device; to be tuned on the H100. 4096 fp32 per program and 8 warps: 16 elements
    per thread and array, 128 KiB moved by a pass-2 program (few tickets and counters per byte).
    The lag is about one wave of resident programs (~2 per SM with pass 2's registers): ~1 M
    elements, 8 MiB of pass-1 reads, well inside L2."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    return FusedConfig(block=4096, reduce_block=512, num_warps=8, lag=2 * _sm_count(device))


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def kernels_run_on(device: torch.device) -> bool:
    """Whether the fused kernels run for tensors on ``device``: CUDA, or the CPU under Triton's
    interpreter (which copies CUDA arguments to the host, so CUDA tensors are not run there)."""
    if config.interpreting():
        return device.type == "cpu"
    return device.type == "cuda"


def supports(p: Tensor) -> bool:
    """Whether the fused path takes parameter ``p``: float32, on a device the kernels run on."""
    return p.dtype == torch.float32 and kernels_run_on(p.device)


def flat_layout(p: Tensor, *others: Tensor) -> bool:
    """Whether ``p`` and ``others`` can be walked as flat arrays whose element i correspond: the
    same sizes and strides, without gaps or overlaps (contiguous in some order of dimensions)."""
    if p.is_contiguous() and all(t.is_contiguous() and t.shape == p.shape for t in others):
        return True
    if any(t.shape != p.shape or t.stride() != p.stride() for t in others):
        return False
    expected = 1
    for size, stride in sorted(zip(p.shape, p.stride(), strict=True), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


# --------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------


def work_schedule(chunks: list[int], lag: int) -> list[int]:
    """Work items in ticket order, each ``2 · chunk + pass`` (pass 0 or 1, chunks numbered over
    all tensors in order; tensor k owns ``chunks[k]`` of them).

    Pass-1 items run in chunk order; tensor k's pass-2 items follow the pass-1 item ``lag`` places
    after its own last one (or the very last), in reverse chunk order; tensors due at the same
    place go latest first. Every pass-2 item thus comes after all of its tensor's pass-1 items,
    which is what makes the kernel's waits safe.
    """
    total = sum(chunks)
    due: dict[int, list[tuple[int, int]]] = {}
    for first, n in zip(_firsts(chunks), chunks, strict=True):
        due.setdefault(min(first + n - 1 + lag, total - 1), []).append((first, n))
    items: list[int] = []
    for c in range(total):
        items.append(2 * c)
        for first, n in reversed(due.get(c, ())):
            items.extend(2 * j + 1 for j in range(first + n - 1, first - 1, -1))
    return items


def _firsts(chunks: list[int]) -> list[int]:
    out, first = [], 0
    for n in chunks:
        out.append(first)
        first += n
    return out


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _power(base, exponent):
    """base^exponent for a float64 scalar base in [0, 1) and a non-negative int32 exponent, by
    squaring: a few float64 roundings, then one to float32 by the caller."""
    result = base * 0.0 + 1.0
    while exponent > 0:
        result = tl.where((exponent & 1) != 0, result * base, result)
        base = base * base
        exponent = exponent >> 1
    return result


@triton.jit
def _lerp(start, end, weight):
    """torch.lerp with a scalar weight: two branches, each exact at its own endpoint."""
    diff = end - start
    return tl.where(weight < 0.5, start + weight * diff, end - diff * (1.0 - weight))


@triton.jit
def _sqrt_u_hat(u, bias2):
    """sqrt(û) = sqrt(u) / sqrt(1 - β2^t), as the foreach path divides."""
    return tl.math.div_rn(tl.sqrt_rn(u), bias2)


@triton.jit
def _stable_adamw_kernel(
    table_ptr,  # (T, _COLUMNS) int64: per tensor, see the column names above
    schedule_ptr,  # (W + C,) int32: W work items in ticket order, then each chunk's tensor
    counters_ptr,  # (1 + T,) int32 zeros: the ticket counter, then one arrival counter per tensor
    partials_ptr,  # (C,) int32: float32 bits of each chunk's Σ (g / max(sqrt(û), ε))²
    scalars_ptr,  # (T, _SCALARS) int32: float32 bits of the scalars pass 2 needs
    skip_ptr,  # (T,) bool: True leaves the tensor as it is (HAS_SKIP)
    lr_ptr,  # () float32: α (LR_IS_TENSOR)
    lr,  # α (not LR_IS_TENSOR)
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    eps,
    floor,  # max(ε, float32's smallest normal): û's floor inside RMS_t is floor²
    clip_threshold,
    weight_decay,
    decay_constant,  # 1 - α λ, rounded once from float64 (DECAY_MODE == DECAY_CONSTANT)
    n_work,
    BLOCK: tl.constexpr,
    REDUCE_BLOCK: tl.constexpr,
    DECAY_MODE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    LR_IS_TENSOR: tl.constexpr,
    TRACK_RMS: tl.constexpr,
):
    """One work item of one StableAdamW step: pass 1 or pass 2 of one BLOCK-element chunk."""
    # float32 as in a compiled kernel (the interpreter hands Python floats over as they are)
    beta1, beta2 = tl.cast(beta1, tl.float32), tl.cast(beta2, tl.float32)
    one_minus_beta1 = tl.cast(one_minus_beta1, tl.float32)
    one_minus_beta2 = tl.cast(one_minus_beta2, tl.float32)
    eps, floor = tl.cast(eps, tl.float32), tl.cast(floor, tl.float32)
    clip_threshold = tl.cast(clip_threshold, tl.float32)
    weight_decay = tl.cast(weight_decay, tl.float32)
    ticket = tl.atomic_add(counters_ptr, 1)
    item = tl.load(schedule_ptr + ticket)
    chunk = item >> 1
    k = tl.load(schedule_ptr + n_work + chunk).to(tl.int64)
    row = table_ptr + k * _COLUMNS
    p_grad = tl.load(row + _GRAD).to(tl.pointer_type(tl.float32))
    p_exp_avg_sq = tl.load(row + _EXP_AVG_SQ).to(tl.pointer_type(tl.float32))
    numel = tl.load(row + _NUMEL)
    first_chunk = tl.load(row + _FIRST_CHUNK)
    n_chunks = tl.load(row + _CHUNKS)
    p_arrivals = counters_ptr + 1 + k
    if HAS_SKIP:
        skipped = tl.load(skip_ptr + k).to(tl.int1)
        numel = tl.where(skipped, 0, numel)  # a skipped tensor's programs move no data
        keep = 1.0 - skipped.to(tl.float32)
    else:
        skipped = tl.full((), 0, tl.int1)
        keep = 1.0
    o_elem = (chunk - first_chunk).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_elem = o_elem < numel

    if (item & 1) == 0:
        # Pass 1: this chunk's share of RMS_t², from the updated second moment.
        p_step = tl.load(row + _STEP).to(tl.pointer_type(tl.float32))
        step = tl.load(p_step) + keep
        exponent = tl.maximum(step, 1.0).to(tl.int32)  # a skipped tensor never stepped: t = 0
        bias2 = tl.sqrt_rn(1.0 - _power(beta2.to(tl.float64), exponent).to(tl.float32))
        b_g = tl.load(p_grad + o_elem, mask=m_elem, other=0.0, eviction_policy="evict_last")
        b_u = tl.load(p_exp_avg_sq + o_elem, mask=m_elem, other=0.0, eviction_policy="evict_last")
        if MAXIMIZE:
            b_g = -b_g
        b_u = b_u * beta2 + one_minus_beta2 * b_g * b_g
        b_ratio = b_g * tl.math.div_rn(1.0, tl.maximum(_sqrt_u_hat(b_u, bias2), floor))
        partial = tl.sum(tl.where(m_elem, b_ratio * b_ratio, 0.0), axis=0)
        tl.atomic_xchg(partials_ptr + chunk, partial.to(tl.int32, bitcast=True))
        tl.debug_barrier()
        arrived = tl.atomic_add(p_arrivals, 1, sem="acq_rel")
        if arrived == n_chunks - 1:
            # The tensor's last pass-1 program: RMS_t, η_t, and the tensor's state scalars.
            o_part = tl.arange(0, REDUCE_BLOCK)
            b_sum = tl.zeros((REDUCE_BLOCK,), tl.float32)
            for start in range(0, n_chunks, REDUCE_BLOCK):
                m_part = start + o_part < n_chunks
                b_bits = tl.load(partials_ptr + first_chunk + start + o_part, mask=m_part,
                                 other=0, volatile=True)
                b_sum += b_bits.to(tl.float32, bitcast=True)
            inv_sqrt_numel = tl.load(row + _INV_SQRT_NUMEL).to(tl.int32).to(tl.float32,
                                                                             bitcast=True)
            rms = tl.sqrt_rn(tl.sum(b_sum, axis=0)) * inv_sqrt_numel
            bias1 = 1.0 - _power(beta1.to(tl.float64), exponent).to(tl.float32)
            if LR_IS_TENSOR:
                alpha = tl.load(lr_ptr)
            else:
                alpha = tl.cast(lr, tl.float32)
            clipped = alpha * tl.math.div_rn(
                1.0, tl.maximum(tl.math.div_rn(rms, clip_threshold), 1.0))
            step_size = -tl.math.div_rn(clipped, bias1)
            if DECAY_MODE == 1:
                shrink = tl.cast(decay_constant, tl.float32)
            elif DECAY_MODE == 2:
                shrink = 1.0 - alpha * weight_decay
            elif DECAY_MODE == 3:
                shrink = 1.0 - clipped * weight_decay
            else:
                shrink = 1.0
            p_scalars = scalars_ptr + k * _SCALARS
            tl.atomic_xchg(p_scalars + _BIAS2, bias2.to(tl.int32, bitcast=True))
            tl.atomic_xchg(p_scalars + _STEP_SIZE, step_size.to(tl.int32, bitcast=True))
            tl.atomic_xchg(p_scalars + _SHRINK, shrink.to(tl.int32, bitcast=True))
            # Every pass-1 program of this tensor has read the step count: it may change now.
            tl.store(p_step, step, mask=skipped == 0)
            if TRACK_RMS:
                p_rms = tl.load(row + _RMS).to(tl.pointer_type(tl.float32))
                tl.store(p_rms, rms, mask=skipped == 0)
            tl.debug_barrier()
            tl.atomic_add(p_arrivals, 1, sem="release")
    else:
        # Pass 2: wait for the tensor's scalars, then the AdamW update with the clipped η_t.
        ready = tl.load(p_arrivals, volatile=True)
        while ready <= n_chunks:
            ready = tl.load(p_arrivals, volatile=True)
        tl.atomic_add(p_arrivals, 0, sem="acquire")
        p_scalars = scalars_ptr + k * _SCALARS
        bias2 = tl.load(p_scalars + _BIAS2, volatile=True).to(tl.float32, bitcast=True)
        step_size = tl.load(p_scalars + _STEP_SIZE, volatile=True).to(tl.float32, bitcast=True)
        shrink = tl.load(p_scalars + _SHRINK, volatile=True).to(tl.float32, bitcast=True)
        p_param = tl.load(row + _PARAM).to(tl.pointer_type(tl.float32))
        p_exp_avg = tl.load(row + _EXP_AVG).to(tl.pointer_type(tl.float32))
        b_g = tl.load(p_grad + o_elem, mask=m_elem, other=0.0, eviction_policy="evict_first")
        b_u = tl.load(p_exp_avg_sq + o_elem, mask=m_elem, other=0.0, eviction_policy="evict_first")
        b_m = tl.load(p_exp_avg + o_elem, mask=m_elem, other=0.0, eviction_policy="evict_first")
        b_p = tl.load(p_param + o_elem, mask=m_elem, other=0.0, eviction_policy="evict_first")
        if MAXIMIZE:
            b_g = -b_g
        b_m = _lerp(b_m, b_g, one_minus_beta1)
        b_u = b_u * beta2 + one_minus_beta2 * b_g * b_g
        b_denom = _sqrt_u_hat(b_u, bias2) + eps
        if DECAY_MODE != 0:
            b_p = b_p * shrink
        b_p = b_p + tl.math.div_rn(b_m, tl.math.div_rn(b_denom, step_size))
        tl.store(p_param + o_elem, b_p, mask=m_elem, eviction_policy="evict_first")
        tl.store(p_exp_avg + o_elem, b_m, mask=m_elem, eviction_policy="evict_first")
        tl.store(p_exp_avg_sq + o_elem, b_u, mask=m_elem, eviction_policy="evict_first")


# --------------------------------------------------------------------------------------------
# Host
# --------------------------------------------------------------------------------------------


@dataclass
class FusedTables:
    """The device tables of one (param group, device), rebuilt only when what they describe
    changes: the schedule when the tensors' sizes do, the address table when an address does
    (a gradient reallocated by ``zero_grad(set_to_none=True)``, state loaded anew)."""

    sizes: tuple[int, ...] = ()
    schedule: Tensor | None = None
    static_rows: list[tuple[int, int, int, int]] = field(default_factory=list)
    n_chunks: int = 0
    n_work: int = 0
    addresses: tuple[int, ...] = ()
    table: Tensor | None = None
    # Host buffers copied into tables while a CUDA graph was captured: the graph copies them
    # again at every replay, so they live as long as the optimizer.
    captured: list[Tensor] = field(default_factory=list)


def _to_device(values: list[int], dtype: torch.dtype, device: torch.device,
               tables: FusedTables) -> Tensor:
    """A host list as a device tensor without synchronizing: through pinned memory and an
    asynchronous copy on CUDA (a pageable copy waits for the stream)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    host = host.pin_memory()
    if torch.cuda.is_current_stream_capturing():
        tables.captured.append(host)
    return host.to(device, non_blocking=True)


def _float32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _update_tables(tables: FusedTables, cfg: FusedConfig, device: torch.device,
                   columns: list[list[Tensor]], rms: list[Tensor] | None) -> None:
    params = columns[0]
    sizes = tuple(p.numel() for p in params)
    if sizes != tables.sizes:
        chunks = [max(1, -(-n // cfg.block)) for n in sizes]  # an empty tensor still gets one
        owners = [k for k, n in enumerate(chunks) for _ in range(n)]
        items = work_schedule(chunks, cfg.lag)
        tables.schedule = _to_device(items + owners, torch.int32, device, tables)
        tables.static_rows = [
            (n, first, c, _float32_bits(1.0 / math.sqrt(max(n, 1))))
            for n, first, c in zip(sizes, _firsts(chunks), chunks, strict=True)
        ]
        tables.sizes, tables.n_chunks, tables.n_work = sizes, len(owners), len(items)
        tables.addresses = ()
    rms_columns = [t.data_ptr() for t in rms] if rms is not None else [0] * len(params)
    addresses = tuple(t.data_ptr() for column in columns for t in column) + tuple(rms_columns)
    if addresses != tables.addresses:
        n = len(params)
        rows = []
        for k, static in enumerate(tables.static_rows):
            rows.extend(addresses[c * n + k] for c in range(len(columns)))
            rows.append(rms_columns[k])
            rows.extend(static)
        tables.table = _to_device(rows, torch.int64, device, tables)
        tables.addresses = addresses


def fused_step(
    tables: FusedTables,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    rms: list[Tensor] | None,
    skip: Tensor | None,
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    clip_threshold: float,
    clip_weight_decay: bool,
    maximize: bool,
) -> None:
    """One StableAdamW step of ``params`` (float32, one device, flat layouts) in one launch.

    ``steps`` and ``rms`` (with track_rms) are the 0-d float32 state tensors, updated in place
    with the moments and parameters; ``skip``: a (len(params),) bool tensor on the device, True
    where a tensor and its state stay exactly as they are.
    """
    device = params[0].device
    cfg = fused_config(device)
    _update_tables(tables, cfg, device, [params, grads, exp_avgs, exp_avg_sqs, steps], rms)
    n_tensors = len(params)
    counters = torch.zeros(1 + n_tensors, dtype=torch.int32, device=device)
    scratch = torch.empty(tables.n_chunks + n_tensors * 4, dtype=torch.int32, device=device)
    beta1, beta2 = betas
    lr_is_tensor = isinstance(lr, Tensor)
    if weight_decay == 0.0:
        decay_mode = DECAY_NONE
    elif clip_weight_decay:
        decay_mode = DECAY_CLIPPED
    elif lr_is_tensor or skip is not None:
        decay_mode = DECAY_LR
    else:
        decay_mode = DECAY_CONSTANT
    lr_tensor = lr.to(device=device, dtype=torch.float32) if lr_is_tensor else None
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        _stable_adamw_kernel[(tables.n_work,)](
            tables.table, tables.schedule, counters, scratch[:tables.n_chunks],
            scratch[tables.n_chunks:], skip, lr_tensor,
            0.0 if lr_is_tensor else float(lr), beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps,
            max(eps, torch.finfo(torch.float32).tiny), clip_threshold, weight_decay,
            1.0 - float(lr) * weight_decay if decay_mode == DECAY_CONSTANT else 1.0,
            tables.n_work,
            BLOCK=cfg.block, REDUCE_BLOCK=cfg.reduce_block, DECAY_MODE=decay_mode,
            MAXIMIZE=maximize, HAS_SKIP=skip is not None, LR_IS_TENSOR=lr_is_tensor,
            TRACK_RMS=rms is not None, num_warps=cfg.num_warps,
        )

