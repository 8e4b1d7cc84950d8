"""Fused step of StableAdamW: one Triton launch updates every tensor of a (param group, device).

The clipped update needs each tensor's RMS_t = sqrt(mean(g² / max(û_t, ε²))), with the *updated*
second moment, before any element of that tensor may move; so every element is visited twice,
by two kinds of programs, each over one chunk of BLOCK elements of one tensor:

- pass 1: u' = β2 u + (1-β2) g² in registers only, the chunk's Σ (g / max(sqrt(û'), ε))² into a
  partials buffer. Reads g and u, writes nothing else;
- pass 2: with the tensor's RMS_t, η_t and bias corrections, m ← lerp(m, g, 1-β1), u ← u',
  θ ← θ·(decay) - η_t m̂ / (sqrt(û) + ε). Reads p, g, m, u; writes p, m, u.

Bytes per fp32 element, from DRAM at worst: 8 + 28 = 36, against fused AdamW's 28 (read p, g, m,
v; write p, m, v), the floor of any AdamW step. Writing m and u in pass 1 instead (pass 1 reads
g, m, u and writes m, u; pass 2 reads p, m, u and writes p) also moves 36, but its pass 1 moves 20
bytes per element instead of 8, and what pass 2 reads again comes from L2 only when little
traffic passed in between: that re-read is the whole margin between 36 and 28. Hence pass 1
stays small and asks L2 to keep its lines (``evict_last``), pass 2 reads and writes with
``evict_first``, and a tensor's pass 2 follows its pass 1 closely in one launch (a second launch
after all of pass 1 would find nothing in L2: one pass over 86 M parameters reads ~690 MB).
Chunks that lie wholly inside their tensor load and store without masks, four elements per
instruction when every address is 16-byte aligned (the host checks; a table of addresses tells
the compiler nothing).

Order inside one launch. Each program takes a ticket from an atomic counter and runs the work
item of that rank in a schedule built on the host (:func:`work_schedule`): the pass-1 items of the
tensors in order, and each tensor's pass-2 items ``lag`` pass-1 items after its last one, in
reverse chunk order (the most recently read data first). A pass-2 program spins until its
tensor's pass 1 is complete. Tickets make the wait safe: whoever holds ticket w knows that every
item ranked before w belongs to a program that already runs, and pass-1 programs wait for
nothing, so the awaited programs finish whatever order the hardware starts blocks in. The lag
lets them finish before their pass 2 is handed out (little spinning); a larger one costs L2 reuse.

The reduction per tensor is deterministic without float atomics: the pass-1 program that arrives
last at its tensor's integer counter adds the tensor's partials in a fixed order, computes RMS_t,
η_t and the bias corrections, writes the tensor's ``step`` and ``rms`` state and three scalars for
pass 2, then bumps the counter once more; pass-2 programs wait for that value. Values that other
programs read during the launch (partials, scalars) are written by integer atomic exchanges of
the program's atomic thread, before its release on the counter; readers spin on volatile loads,
acquire with an atomic, and read with volatile loads (past the non-coherent L1).

The arithmetic follows ``StableAdamW``'s foreach path operation by operation (correctly rounded
division and square root, the same float32 constants), so the two agree to float32 rounding: the
norm's summation order and contractions into fma differ. Under Triton's interpreter, programs run
one after another in ticket order, so every wait is already satisfied when it starts.

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
    """Launch shape: ``block`` elements per program, walked ``sub_block`` at a time (a loop:
    the registers of ``sub_block`` elements, the per-program overhead of ``block``),
    ``reduce_block`` partials per load, ``lag`` pass-1 items between a tensor's last pass-1
    item and its pass-2 items."""

    block: int
    reduce_block: int
    num_warps: int
    lag: int
    sub_block: int = 0  # 0: the whole block at once

    @property
    def step(self) -> int:
        return self.sub_block or self.block


# Small chunks under the interpreter, so that tiny test tensors span several programs.
INTERPRETER_CONFIG = FusedConfig(block=8, reduce_block=4, num_warps=1, lag=1, sub_block=4)


def fused_config(device: torch.device) -> FusedConfig:
    """Frozen per device. 32768 fp32 per program, walked 4096 at a time by 16 warps, and a lag
    of two items per SM. Large chunks mean few programs, each of which pays a ticket, a few
    dependent table loads and, in pass 2, a wait before its first byte moves; walking a chunk in
    steps keeps it from spilling registers (docs/companions.md, StableAdamW, "How the launch
    shape was found").
    ``core.config.Tuning.optim_config`` ("block,num_warps,lag[,sub_block]", from
    ``FUSEDLOSS_OPTIM_CONFIG``) overrides it on CUDA (for tuning; powers of two, reduce_block
    stays 512)."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    if spec := config.tuning().optim_config:
        try:
            block, num_warps, lag, *sub = (int(x) for x in spec.split(","))
        except ValueError:
            raise ValueError(f"optim_config (FUSEDLOSS_OPTIM_CONFIG) must be "
                             f"'block,num_warps,lag[,sub_block]' (integers), "
                             f"got {spec!r}") from None
        sub_block = sub[0] if sub else block
        if (block < 512 or block & (block - 1) or num_warps not in (1, 2, 4, 8, 16, 32)
                or lag < 0 or len(sub) > 1 or sub_block < 512 or sub_block & (sub_block - 1)
                or sub_block > block):
            raise ValueError(f"optim_config (FUSEDLOSS_OPTIM_CONFIG): block and sub_block must "
                             f"be powers of two ≥ 512, sub_block ≤ block, num_warps 1–32 "
                             f"(a power of two), lag ≥ 0; got {spec!r}")
        return FusedConfig(block=block, reduce_block=512, num_warps=num_warps, lag=lag,
                           sub_block=sub_block)
    return FusedConfig(block=32768, reduce_block=512, num_warps=16, lag=2 * config.sm_count(device),
                       sub_block=4096)


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
def _load(ptrs, mask, MASKED: tl.constexpr, EVICTION: tl.constexpr):
    if MASKED:
        values = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=EVICTION)
    else:
        values = tl.load(ptrs, eviction_policy=EVICTION)
    return values


@triton.jit
def _store(ptrs, values, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, values, mask=mask, eviction_policy="evict_first")
    else:
        tl.store(ptrs, values, eviction_policy="evict_first")


@triton.jit
def _pass1_chunk(p_grad, p_exp_avg_sq, o_elem, numel, bias2, beta2, one_minus_beta2, floor,
                 MAXIMIZE: tl.constexpr, MASKED: tl.constexpr):
    """Σ (g / max(sqrt(û), ε))² over one chunk, with u updated in registers only. Its lines are
    asked to stay in L2 for pass 2."""
    m_elem = o_elem < numel
    b_g = _load(p_grad + o_elem, m_elem, MASKED, "evict_last")
    b_u = _load(p_exp_avg_sq + o_elem, m_elem, MASKED, "evict_last")
    if MAXIMIZE:
        b_g = -b_g
    b_u = b_u * beta2 + one_minus_beta2 * b_g * b_g
    b_ratio = b_g * tl.math.div_rn(1.0, tl.maximum(_sqrt_u_hat(b_u, bias2), floor))
    b_square = b_ratio * b_ratio
    if MASKED:
        b_square = tl.where(m_elem, b_square, 0.0)
    return tl.sum(b_square, axis=0)


@triton.jit
def _pass2_chunk(p_param, p_grad, p_exp_avg, p_exp_avg_sq, o_elem, numel, bias2, step_size,
                 shrink, beta2, one_minus_beta1, one_minus_beta2, eps, DECAY: tl.constexpr,
                 MAXIMIZE: tl.constexpr, MASKED: tl.constexpr):
    """The AdamW update of one chunk with the tensor's clipped step size, in the foreach path's
    order of operations: m ← lerp(m, g, 1-β1), u ← β2 u + (1-β2) g², θ ← θ·shrink + m / d with
    d = (sqrt(û) + ε) / step_size. Every line is read for the last time."""
    m_elem = o_elem < numel
    b_g = _load(p_grad + o_elem, m_elem, MASKED, "evict_first")
    b_u = _load(p_exp_avg_sq + o_elem, m_elem, MASKED, "evict_first")
    b_m = _load(p_exp_avg + o_elem, m_elem, MASKED, "evict_first")
    b_p = _load(p_param + o_elem, m_elem, MASKED, "evict_first")
    if MAXIMIZE:
        b_g = -b_g
    b_m = _lerp(b_m, b_g, one_minus_beta1)
    b_u = b_u * beta2 + one_minus_beta2 * b_g * b_g
    b_denom = _sqrt_u_hat(b_u, bias2) + eps
    if DECAY:
        b_p = b_p * shrink
    b_p = b_p + tl.math.div_rn(b_m, tl.math.div_rn(b_denom, step_size))
    _store(p_param + o_elem, b_p, m_elem, MASKED)
    _store(p_exp_avg + o_elem, b_m, m_elem, MASKED)
    _store(p_exp_avg_sq + o_elem, b_u, m_elem, MASKED)


@triton.jit
def _address(p_entry, ALIGNED: tl.constexpr):
    """The float32 array at the address in a table entry; ALIGNED: 16-byte aligned, which lets
    the compiler load four elements per instruction (nothing tells it from a table)."""
    address = tl.load(p_entry).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        address = tl.multiple_of(address, 16)
    return address


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
    SUB_BLOCK: tl.constexpr,  # elements per loop step, a divisor of BLOCK
    REDUCE_BLOCK: tl.constexpr,
    DECAY_MODE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    LR_IS_TENSOR: tl.constexpr,
    TRACK_RMS: tl.constexpr,
    ALIGNED: tl.constexpr,  # every p, g, m, u address is a multiple of 16 bytes
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
    p_grad = _address(row + _GRAD, ALIGNED)
    p_exp_avg_sq = _address(row + _EXP_AVG_SQ, ALIGNED)
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
    o_chunk = (chunk - first_chunk).to(tl.int64) * BLOCK
    o_step = tl.arange(0, SUB_BLOCK)
    in_bounds = (chunk - first_chunk + 1) * BLOCK <= numel  # no mask: four elements per load

    if (item & 1) == 0:
        # Pass 1: this chunk's share of RMS_t², from the updated second moment.
        p_step = tl.load(row + _STEP).to(tl.pointer_type(tl.float32))
        step = tl.load(p_step) + keep
        exponent = tl.maximum(step, 1.0).to(tl.int32)  # a skipped tensor never stepped: t = 0
        bias2 = tl.sqrt_rn(1.0 - _power(beta2.to(tl.float64), exponent).to(tl.float32))
        partial = tl.zeros((), tl.float32)
        for offset in range(0, BLOCK, SUB_BLOCK):
            o_elem = o_chunk + offset + o_step
            if in_bounds:
                partial += _pass1_chunk(p_grad, p_exp_avg_sq, o_elem, numel, bias2, beta2,
                                        one_minus_beta2, floor, MAXIMIZE, False)
            else:
                partial += _pass1_chunk(p_grad, p_exp_avg_sq, o_elem, numel, bias2, beta2,
                                        one_minus_beta2, floor, MAXIMIZE, True)
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
            if DECAY_MODE == 1:  # DECAY_CONSTANT, DECAY_LR, DECAY_CLIPPED below
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
        p_param = _address(row + _PARAM, ALIGNED)
        p_exp_avg = _address(row + _EXP_AVG, ALIGNED)
        for offset in range(0, BLOCK, SUB_BLOCK):
            o_elem = o_chunk + offset + o_step
            if in_bounds:
                _pass2_chunk(p_param, p_grad, p_exp_avg, p_exp_avg_sq, o_elem, numel, bias2,
                             step_size, shrink, beta2, one_minus_beta1, one_minus_beta2, eps,
                             DECAY_MODE != 0, MAXIMIZE, False)
            else:
                _pass2_chunk(p_param, p_grad, p_exp_avg, p_exp_avg_sq, o_elem, numel, bias2,
                             step_size, shrink, beta2, one_minus_beta1, one_minus_beta2, eps,
                             DECAY_MODE != 0, MAXIMIZE, True)


# --------------------------------------------------------------------------------------------
# Host
# --------------------------------------------------------------------------------------------


# One tensor's (param, grad, exp_avg, exp_avg_sq, step, rms or None): the table's address columns.
TensorRow = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, "Tensor | None"]


@dataclass(frozen=True)
class Schedule:
    """What depends only on the tensors' sizes: the work items and each chunk's tensor (device
    int32), and per tensor (numel, first chunk, chunks, float32 bits of 1/sqrt(max(numel, 1)))."""

    items_and_owners: Tensor
    static_rows: list[tuple[int, int, int, int]]
    n_chunks: int
    n_work: int


@dataclass
class FusedTables:
    """The device tables of one (param group, device), rebuilt only when what they describe
    changes: a schedule per set of sizes (a few kept: gradients that come and go), the address
    table when an address does (a gradient reallocated by ``zero_grad(set_to_none=True)``, state
    loaded anew)."""

    schedules: dict[tuple, Schedule] = field(default_factory=dict)
    addresses: tuple[int, ...] = ()
    table: Tensor | None = None
    aligned: bool = False  # every p, g, m, u address a multiple of 16 bytes
    # Host buffers copied into tables while a CUDA graph was captured: the graph copies them
    # again at every replay, so they live as long as the optimizer.
    captured: list[Tensor] = field(default_factory=list)


_SCHEDULES_KEPT = 4


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


def _schedule(tables: FusedTables, cfg: FusedConfig, device: torch.device,
              sizes: tuple[int, ...]) -> Schedule:
    key = (sizes, cfg)
    schedule = tables.schedules.pop(key, None)
    if schedule is None:
        chunks = [max(1, -(-n // cfg.block)) for n in sizes]  # an empty tensor still gets one
        owners = [k for k, n in enumerate(chunks) for _ in range(n)]
        items = work_schedule(chunks, cfg.lag)
        schedule = Schedule(
            _to_device(items + owners, torch.int32, device, tables),
            [(n, first, c, _float32_bits(1.0 / math.sqrt(max(n, 1))))
             for n, first, c in zip(sizes, _firsts(chunks), chunks, strict=True)],
            n_chunks=len(owners), n_work=len(items),
        )
        if len(tables.schedules) >= _SCHEDULES_KEPT:
            del tables.schedules[next(iter(tables.schedules))]
    tables.schedules[key] = schedule  # most recently used last
    return schedule


def _address_table(tables: FusedTables, schedule: Schedule, device: torch.device,
                   rows: list[TensorRow]) -> Tensor:
    """The (T, _COLUMNS) int64 table: p, g, m, u, step, rms addresses, then the sizes."""
    addresses = [t.data_ptr() if t is not None else 0 for row in rows for t in row]
    key = (id(schedule), *addresses)
    if key != tables.addresses:
        columns = len(rows[0])
        table: list[int] = []
        for k, static in enumerate(schedule.static_rows):
            table.extend(addresses[k * columns:(k + 1) * columns])
            table.extend(static)
        tables.table = _to_device(table, torch.int64, device, tables)
        tables.addresses = key
        tables.aligned = all(a % 16 == 0 for k in range(len(rows))
                             for a in addresses[k * columns:k * columns + 4])
    return tables.table


def fused_step(
    tables: FusedTables,
    rows: list[TensorRow],
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
    """One StableAdamW step of the tensors in ``rows`` (float32, one device, flat layouts), in
    one launch, everything updated in place. ``rms`` is None in every row or in none (without
    track_rms). ``skip``: a (len(rows),) bool tensor on the device, True where a tensor and its
    state stay exactly as they are.
    """
    device = rows[0][0].device
    cfg = fused_config(device)
    schedule = _schedule(tables, cfg, device, tuple(row[0].numel() for row in rows))
    table = _address_table(tables, schedule, device, rows)
    n_tensors, n_chunks = len(rows), schedule.n_chunks
    counters = torch.zeros(1 + n_tensors, dtype=torch.int32, device=device)
    scratch = torch.empty(n_chunks + n_tensors * _SCALARS.value, dtype=torch.int32, device=device)
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
        _stable_adamw_kernel[(schedule.n_work,)](
            table, schedule.items_and_owners, counters, scratch[:n_chunks], scratch[n_chunks:],
            skip, lr_tensor,
            0.0 if lr_is_tensor else float(lr), beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps,
            max(eps, torch.finfo(torch.float32).tiny), clip_threshold, weight_decay,
            1.0 - float(lr) * weight_decay if decay_mode == DECAY_CONSTANT else 1.0,
            schedule.n_work,
            BLOCK=cfg.block, SUB_BLOCK=cfg.step, REDUCE_BLOCK=cfg.reduce_block,
            DECAY_MODE=decay_mode,
            MAXIMIZE=maximize, HAS_SKIP=skip is not None, LR_IS_TENSOR=lr_is_tensor,
            TRACK_RMS=rows[0][5] is not None, ALIGNED=tables.aligned, num_warps=cfg.num_warps,
        )

