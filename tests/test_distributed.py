"""fusedloss.distributed on gloo process groups of 1–4 CPU processes.

The pattern of flash-attention's distributed tests: every rank's loss and gradients must equal
the single-process loss of the concatenated batch, sliced to that rank (and scaled as the
gradient convention of ``fusedloss/distributed/contrastive.py`` says). The single-process
losses are themselves tested against ``fusedloss/reference.py``. Hypothesis draws the world
size, each rank's batch (0 rows included), the width, the dtype and the reduction; the ranks
run in worker processes that live for the whole module (``workers.py``).
"""

from __future__ import annotations

import hashlib
import math
import os
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import DEVICE, can_run_triton
from hypothesis import given, settings
from hypothesis import strategies as st
from workers import NCCL_EXAMPLES, Raised, Workers, all_ok

import fusedloss
import fusedloss.distributed as fd
from fusedloss.distributed import ring

KINDS = ("clip", "siglip", "info_nce", "nt_xent")
# The workers' tensors live on the CPU: the Triton kernels run there through the interpreter.
RING_BACKENDS = ("torch", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("torch",)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The ring adds W blocks' fp32 gradients and rounds once; one process rounds once too, but
# its fp32 sums run in another order: a few fp32 ulps, or one rounding of the input dtype.
TOL = {"fp32": dict(rtol=2e-5, atol=2e-6), "bf16": dict(rtol=2e-2, atol=2e-3)}  # losses



# ---------------------------------------------------------------------------------------------
# one case: the global batch (the same on every process, from a seed), each rank's slice


def _global_batch(kind, rows, cols, d, dtype, seed):
    """Global inputs (fp32 leaves, rounded to ``dtype``) for a loss, from per-rank counts."""
    g = torch.Generator().manual_seed(seed)

    def unit(n):
        # Peaked-ish logits at the scales below: clustered unit vectors.
        x = torch.randn(n, d, generator=g)
        return F.normalize(x, dim=1).to(dtype)

    n, m = sum(rows), sum(cols)
    if kind == "nt_xent":
        base = unit(n)
        return dict(z1=base, z2=F.normalize(base.float() + 0.3 * unit(n).float(), dim=1).to(dtype))
    if kind == "info_nce":
        return dict(q=unit(n), k=unit(m), labels=torch.randint(0, max(m, 1), (n,), generator=g))
    return dict(i=unit(n), t=unit(n))


def _slice(x, sizes, r):
    off = sum(sizes[:r])
    return x[off:off + sizes[r]]


def _nt_xent_rows(rows, r):
    """Rank r's rows [z1_r; z2_r] in the global order [z1; z2]."""
    b, off, n = sum(rows), sum(rows[:r]), rows[r]
    return torch.cat([torch.arange(off, off + n), torch.arange(b + off, b + off + n)])


def _weights(n, seed):
    """Upstream gradients of a "none" reduction: not all equal, so each row's counts."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed + 1)) + 0.5


def _ring_case(rank, world, kind, rows, cols, d, dtype, reduction, backend, seed, filter_eps,
               device="cpu"):
    """On every rank: the ring loss of this rank's slice, backward; returns (loss, grads) on the
    CPU. ``device="cuda"``: each rank's tensors on its GPU (NCCL workers)."""
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    batch = {k: v.to(dev) for k, v in
             _global_batch(kind, rows, cols, d, DTYPES[dtype], seed).items()}
    scale = torch.tensor(4.0 if kind != "siglip" else 3.0, device=dev, requires_grad=True)
    bias = torch.tensor(-2.0, device=dev, requires_grad=True)
    common = dict(backend=backend)
    if kind != "siglip":
        common.update(reduction=reduction, filter_eps=filter_eps)
    if kind == "nt_xent":
        z = torch.cat([_slice(batch["z1"], rows, rank), _slice(batch["z2"], rows, rank)])
        leaves = [z.clone().requires_grad_(), scale]
        loss = fd.nt_xent_loss(leaves[0], 1 / scale, **common)
    elif kind == "info_nce":
        q, k = _slice(batch["q"], rows, rank), _slice(batch["k"], cols, rank)
        labels = _slice(batch["labels"], rows, rank)
        leaves = [q.clone().requires_grad_(), k.clone().requires_grad_(), scale]
        loss = fd.info_nce_loss(leaves[0], leaves[1], labels, temperature=1 / scale, **common)
    else:
        i, t = _slice(batch["i"], rows, rank), _slice(batch["t"], rows, rank)
        leaves = [i.clone().requires_grad_(), t.clone().requires_grad_(), scale]
        if kind == "siglip":
            leaves.append(bias)
            loss = fd.siglip_loss(leaves[0], leaves[1], scale, bias, **common)
        else:
            loss = fd.clip_loss(leaves[0], leaves[1], scale, **common)
    if reduction == "none" and kind != "siglip":
        if kind == "nt_xent":  # this rank's rows of the global [z1; z2] order
            upstream = _weights(2 * sum(rows), seed)[_nt_xent_rows(rows, rank)]
        else:
            upstream = _slice(_weights(sum(rows), seed), rows, rank)
        (loss * upstream.to(dev)).sum().backward()
    else:
        loss.backward()
    return loss.detach().cpu(), [leaf.grad.cpu() for leaf in leaves]


def _reference(kind, rows, cols, d, dtype, reduction, seed, backend="torch"):
    """One process, the concatenated batch: (per-rank expected loss, per-rank grads, shared
    grads summed over ranks), all in the ring's scaling."""
    batch = _global_batch(kind, rows, cols, d, DTYPES[dtype], seed)
    world = len(rows)
    scale = torch.tensor(4.0 if kind != "siglip" else 3.0, requires_grad=True)
    bias = torch.tensor(-2.0, requires_grad=True)
    red = "mean" if kind == "siglip" else ("none" if reduction == "none" else reduction)
    common = dict(backend=backend)
    if kind != "siglip":
        common.update(reduction=red, filter_eps=None)
    if kind == "nt_xent":
        z = torch.cat([batch["z1"], batch["z2"]]).requires_grad_()
        feats = [z]
        loss = fusedloss.nt_xent_loss(z, 1 / scale, **common)
    elif kind == "info_nce":
        feats = [batch["q"].clone().requires_grad_(), batch["k"].clone().requires_grad_()]
        loss = fusedloss.info_nce_loss(*feats, batch["labels"], temperature=1 / scale, **common)
    else:
        feats = [batch["i"].clone().requires_grad_(), batch["t"].clone().requires_grad_()]
        if kind == "siglip":
            loss = fusedloss.siglip_loss(*feats, scale, bias, **common)
        else:
            loss = fusedloss.clip_loss(*feats, scale, **common)
    if reduction == "none" and kind != "siglip":
        n = loss.shape[0]
        (loss * _weights(n, seed)).sum().backward()
    else:
        # The ring's scaling as the upstream gradient, as the ring applies it: the kernels
        # round the same scaled dX to the features' dtype (scaling the gradients afterwards
        # rounds differently, by up to a bf16 ulp of every term of a cancelling sum).
        (loss * world).backward()
    shared = [scale.grad] + ([bias.grad] if kind == "siglip" else [])
    per_rank = []
    for r in range(world):
        if kind == "nt_xent":
            pick = _nt_xent_rows(rows, r)
            grads = [feats[0].grad[pick]]
            value = loss.detach()[pick] if reduction == "none" else None
        else:
            col_sizes = cols if kind == "info_nce" else rows
            grads = [_slice(feats[0].grad, rows, r), _slice(feats[1].grad, col_sizes, r)]
            value = _slice(loss.detach(), rows, r) if reduction == "none" and \
                kind != "siglip" else None
        per_rank.append((value, grads))
    return loss.detach(), per_rank, shared


def _check(kind, rows, cols, d, dtype, reduction, results, seed, backend="torch"):
    """Each rank's results against one process on the whole batch, same dtype and backend."""
    world = len(rows)
    total, per_rank, shared = _reference(kind, rows, cols, d, dtype, reduction, seed, backend)
    tol = TOL[dtype]
    if reduction == "none" and kind != "siglip":
        for r, ((value, _), (loss, _)) in enumerate(zip(per_rank, results, strict=True)):
            torch.testing.assert_close(loss, value, **TOL["fp32"],
                                       msg=lambda m, r=r: f"rank {r} per-row loss: {m}")
    else:
        # Σ_r ℓ_r = W·L: the mean of the ranks' values is the global loss.
        mean = torch.stack([loss for loss, _ in results]).mean()
        torch.testing.assert_close(mean, total, **TOL["fp32"])
    n_feats = 1 if kind == "nt_xent" else 2
    for r, ((_, want), (_, got)) in enumerate(zip(per_rank, results, strict=True)):
        for j in range(n_feats):
            # Sums of terms of either sign, in another order: a few ulps of the terms (× W,
            # the ring's scaling), not of their sum. bf16: dX is rounded to bf16 before the
            # matmuls (both ways), and the ring's merged statistics may differ in the last fp32
            # bit, flipping a rounding: a bf16 ulp of the largest terms.
            tol = dict(rtol=2e-5, atol=2e-5 * world) if dtype == "fp32" else dict(
                rtol=2e-2, atol=2e-2 * max([1.0, *want[j].abs().flatten().tolist()]))
            torch.testing.assert_close(got[j].float(), want[j].float(), **tol,
                                       msg=lambda m, r=r, j=j: f"rank {r} grad {j}: {m}")
    for j, want in enumerate(shared):
        got = sum(res[1][n_feats + j] for res in results)
        # (the Triton backend forms d bias from dX rounded to the input dtype)
        loose = dict(rtol=1e-4, atol=1e-5 * world) if dtype == "fp32" else TOL[dtype]
        torch.testing.assert_close(got, want, **loose,
                                   msg=lambda m, j=j: f"shared grad {j} summed over ranks: {m}")


@st.composite
def ring_cases(draw, backends=("torch",), max_world=4, max_rows=5):
    kind = draw(st.sampled_from(KINDS))
    world = draw(st.integers(1, max_world))
    limit = 3 if kind == "nt_xent" else max_rows
    rows = draw(st.lists(st.integers(0, limit), min_size=world, max_size=world)
                .filter(lambda xs: sum(xs) > 0))
    cols = rows
    if kind == "info_nce":
        cols = draw(st.lists(st.integers(0, max_rows), min_size=world, max_size=world)
                    .filter(lambda xs: sum(xs) > 0))
    return dict(kind=kind, rows=rows, cols=cols, d=draw(st.integers(1, 9)),
                dtype=draw(st.sampled_from(sorted(DTYPES))),
                reduction=draw(st.sampled_from(["mean", "sum", "none"])),
                backend=draw(st.sampled_from(backends)), seed=draw(st.integers(0, 2**16)))


@pytest.mark.slow
@given(case=ring_cases(backends=RING_BACKENDS))
def test_ring_equals_one_process_sliced(workers, case):
    c = case
    results = all_ok(workers(len(c["rows"])).run(
        _ring_case, c["kind"], c["rows"], c["cols"], c["d"], c["dtype"], c["reduction"],
        c["backend"], c["seed"], None))
    _check(c["kind"], c["rows"], c["cols"], c["d"], c["dtype"], c["reduction"], results,
           c["seed"], c["backend"])


NCCL_WORLD = min(torch.cuda.device_count(), 8)  # one process per GPU, up to 8


@pytest.mark.skipif(NCCL_WORLD < 2, reason="needs two or more CUDA GPUs")
@settings(max_examples=NCCL_EXAMPLES)
@given(case=ring_cases(backends=("triton", "torch"), max_world=max(NCCL_WORLD, 1)))
def test_ring_on_nccl_equals_one_process_sliced(nccl_workers, case):
    """The same property over NCCL, one process per GPU (the Triton kernels at tiny sizes);
    the reference: one process on the CPU."""
    c = case
    results = all_ok(nccl_workers(len(c["rows"])).run(
        _ring_case, c["kind"], c["rows"], c["cols"], c["d"], c["dtype"], c["reduction"],
        c["backend"], c["seed"], None, "cuda"))
    _check(c["kind"], c["rows"], c["cols"], c["d"], c["dtype"], c["reduction"], results,
           c["seed"], "torch")


@pytest.mark.parametrize("kind", KINDS)
def test_ring_triton_kernels(workers, kind):
    """The Triton kernels under the ring's block calls (on the CPU: Triton's interpreter),
    uneven batches with an empty rank."""
    if "triton" not in RING_BACKENDS:
        pytest.skip("CPU workers run the Triton kernels only under TRITON_INTERPRET=1")
    rows = [2, 0, 3] if kind == "nt_xent" else [5, 0, 7]
    cols = [3, 4, 0] if kind == "info_nce" else rows
    for reduction in ("mean", "none"):
        results = all_ok(workers(3).run(_ring_case, kind, rows, cols, 16, "fp32", reduction,
                                     "triton", 7, None))
        _check(kind, rows, cols, 16, "fp32", reduction, results, 7, "triton")
    # Deterministic: the same call gives the same bits (no atomics, a fixed ring order).
    again = all_ok(workers(3).run(_ring_case, kind, rows, cols, 16, "fp32", "none", "triton", 7,
                               None))
    for (loss, grads), (loss2, grads2) in zip(results, again, strict=True):
        assert torch.equal(loss, loss2)
        assert all(torch.equal(g, g2) for g, g2 in zip(grads, grads2, strict=True))


def _backward_events(rank, world, kind, rows):
    """The order of the ring's backward on this rank: ("block", columns) per engine.grads
    call (the block it holds) and ("post", bytes) per transfer posted."""
    cols = rows
    batch = _global_batch(kind, rows, cols, 4, torch.float32, 11)
    a, b = (_slice(x, rows, rank).clone().requires_grad_() for x in list(batch.values())[:2])
    loss = (fd.clip_loss(a, b, 5.0, backend="torch") if kind == "clip"
            else fd.siglip_loss(a, b, 5.0, -1.0, backend="torch"))
    events, real_shift, real_grads = [], ring.Shift, ring.engine.grads

    class LoggedShift(real_shift):
        def __init__(self, layout, send, recv, tag=0):
            events.append(("post", sum(t.numel() * t.element_size() for t in send)))
            super().__init__(layout, send, recv, tag=tag)

    def logged_grads(a, b, *args, **kwargs):
        events.append(("block", b.shape[0]))
        return real_grads(a, b, *args, **kwargs)

    ring.Shift, ring.engine.grads = LoggedShift, logged_grads
    try:
        loss.sum().backward()
    finally:
        ring.Shift, ring.engine.grads = real_shift, real_grads
    return events


@pytest.mark.parametrize("kind", ["clip", "siglip"])
# Four ranks (~9 s on two cores): make test-slow.
@pytest.mark.parametrize("rows", [[2, 3], [2, 3, 4],
                                  pytest.param([2, 3, 4, 5], marks=pytest.mark.slow)])
def test_ring_backward_ends_at_home(workers, kind, rows):
    """The backward tours the other way round from the forward: rank r starts with the block
    it held last in the forward (r + 1's) and ends with its own, and posts nothing after its
    last block's compute (each block's gradient accumulator is complete at home)."""
    world = len(rows)
    for r, events in enumerate(all_ok(workers(world).run(_backward_events, kind, rows))):
        blocks = [size for what, size in events if what == "block"]
        assert blocks == [rows[(r + 1 + k) % world] for k in range(world)]
        assert events[-1] == ("block", rows[r])
        assert any(what == "post" for what, _ in events)


def _siglip_blocks(rank, world, rows):
    """SigLIP on the Triton backend: the blocks of this rank's calls of SigLIP's chunked path
    (columns, whether they hold this rank's positives) and whether the tiled engine ran."""
    from fusedloss.core import chunked_contrastive

    batch = _global_batch("siglip", rows, rows, 8, torch.float32, 13)
    a, b = (_slice(x, rows, rank).clone().requires_grad_() for x in list(batch.values())[:2])
    calls, engine_calls = [], []
    real_chunks, real_grads, real_stats = (chunked_contrastive.siglip_loss_and_grads,
                                           ring.engine.grads, ring.engine.row_stats)

    def logged_chunks(a, b, *args, positives=True, **kwargs):
        calls.append((b.shape[0], positives))
        return real_chunks(a, b, *args, positives=positives, **kwargs)

    def logged_engine(*args, **kwargs):
        engine_calls.append(1)
        return real_grads(*args, **kwargs)

    chunked_contrastive.siglip_loss_and_grads = logged_chunks
    ring.engine.grads = ring.engine.row_stats = logged_engine
    try:
        fd.siglip_loss(a, b, 5.0, -1.0, backend="triton").backward()
    finally:
        chunked_contrastive.siglip_loss_and_grads = real_chunks
        ring.engine.grads, ring.engine.row_stats = real_grads, real_stats
    return calls, engine_calls


def test_ring_siglip_forms_its_gradients_in_one_tour(workers):
    """SigLIP on the ring, Triton backend: one call of the three-product chunked path per block
    in the forward's order, the home block's with the positives, none of the tiled engine
    (its forward and backward would multiply four times)."""
    if "triton" not in RING_BACKENDS:
        pytest.skip("CPU workers run the Triton kernels only under TRITON_INTERPRET=1")
    rows = [3, 2, 4]
    for r, (calls, engine_calls) in enumerate(all_ok(workers(3).run(_siglip_blocks, rows))):
        assert calls == [(rows[(r - k) % 3], k == 0) for k in range(3)]
        assert engine_calls == []


# ---------------------------------------------------------------------------------------------
# filtering over the ring


def _filtered_clip(rank, world, filter_eps, dtype_name, tile_budget=None):
    """CLIP over 2 ranks on peaked inputs where the other rank's block carries almost no mass."""
    g = torch.Generator().manual_seed(3)
    d, b, dtype = 16, 8, DTYPES[dtype_name]
    centres = F.normalize(torch.randn(world, d, generator=g), dim=1)
    # Each rank's pairs cluster around its own centre: the other block is far below the diagonal.
    i = F.normalize(centres[rank] + 0.05 * torch.randn(b, d, generator=g), dim=1).to(dtype)
    t = F.normalize(i.float() + 0.01 * torch.randn(b, d, generator=g), dim=1).to(dtype)
    i, t = i.requires_grad_(), t.requires_grad_()
    budget = ring.TILE_STATS_BUDGET
    if tile_budget is not None:
        ring.TILE_STATS_BUDGET = tile_budget
    try:
        loss = fd.clip_loss(i, t, 30.0, backend="triton", filter_eps=filter_eps)
    finally:
        ring.TILE_STATS_BUDGET = budget
    loss.backward()
    return i.grad.float(), t.grad.float()


def test_ring_filter_eps_skips_blocks(workers):
    if "triton" not in RING_BACKENDS:
        pytest.skip("CPU workers run the Triton kernels only under TRITON_INTERPRET=1")
    exact = all_ok(workers(2).run(_filtered_clip, None, "fp32"))
    filtered = all_ok(workers(2).run(_filtered_clip, 0.25, "fp32"))
    for (ei, et), (fi, ft) in zip(exact, filtered, strict=True):
        diff = max((fi - ei).abs().max(), (ft - et).abs().max())
        assert diff > 0, "filter_eps was ignored: the far block was computed"
        # Each row and column loses at most eps of its gradient mass: a small change.
        scale = max(ei.abs().max(), et.abs().max())
        assert diff <= 0.25 * scale
    # Past the tile-statistics budget the ring keeps none and computes every tile.
    unfiltered = all_ok(workers(2).run(_filtered_clip, 0.25, "fp32", 0))
    for (ei, et), (ui, ut) in zip(exact, unfiltered, strict=True):
        torch.testing.assert_close(ui, ei)
        torch.testing.assert_close(ut, et)


# ---------------------------------------------------------------------------------------------
# process groups other than the world


def _subgroup_case(rank, world, seed):
    group = dist.new_group([0, 2])  # every rank creates it; rank 1 is not in it
    if rank == 1:
        return None
    rows = [3, 4]
    batch = _global_batch("clip", rows, rows, 6, torch.float32, seed)
    r = 0 if rank == 0 else 1
    i = _slice(batch["i"], rows, r).clone().requires_grad_()
    t = _slice(batch["t"], rows, r).clone().requires_grad_()
    scale = torch.tensor(4.0, requires_grad=True)
    loss = fd.clip_loss(i, t, scale, group=group, backend="torch")
    loss.backward()
    dist.destroy_process_group(group)
    return loss.detach(), [i.grad, t.grad, scale.grad]


def test_ring_on_a_subgroup(workers):
    results = all_ok(workers(3).run(_subgroup_case, 5))
    assert results[1] is None
    _check("clip", [3, 4], [3, 4], 6, "fp32", "mean", [results[0], results[2]], 5)


# ---------------------------------------------------------------------------------------------
# errors: the same error on every rank, never a hang


def _disagreeing(rank, world, what):
    d = 4 + (rank if what == "width" else 0)
    dtype = torch.bfloat16 if what == "dtype" and rank == 1 else torch.float32
    x = torch.randn(3, d, dtype=dtype)
    if what == "reduction":
        return fd.clip_loss(x, x, 2.0, reduction="sum" if rank else "mean", backend="torch")
    if what == "odd-rows" and rank == 1:
        return fd.nt_xent_loss(torch.randn(3, 4), backend="torch")
    if what == "odd-rows":
        return fd.nt_xent_loss(torch.randn(4, 4), backend="torch")
    if what == "labels":
        labels = torch.tensor([0, 1, 5 if rank == 1 else 2])
        return fd.info_nce_loss(x, x, labels, backend="torch")  # 6 keys in all: 5 is fine
    if what == "labels-out-of-range":
        labels = torch.tensor([0, 1, 6 if rank == 1 else 2])
        return fd.info_nce_loss(x, x, labels, backend="torch")
    if what == "empty":
        return fd.clip_loss(x[:0], x[:0], 2.0, backend="torch")
    if what == "module-rank":
        return fusedloss.ClipLoss(local_loss=True, gather_with_grad=True, rank=0,
                                  world_size=world, backend="torch")(x, x, 2.0)
    return fd.clip_loss(x, x, 2.0, backend="torch")


@pytest.mark.parametrize("what,kind,message", [
    ("width", "ValueError", "the feature width D"),
    ("dtype", "ValueError", "the feature dtype"),
    ("reduction", "ValueError", "reduction"),
    ("labels-out-of-range", "ValueError", "labels on rank 1 holds 6"),
    ("empty", "ValueError", "the global batch is empty"),
])
def test_disagreement_raises_on_every_rank(workers, what, kind, message):
    results = workers(2).run(_disagreeing, what)
    for rank, r in enumerate(results):
        assert isinstance(r, Raised), f"rank {rank} did not raise"
        assert r.type == kind and message in r.message, (rank, r.type, r.message)


@pytest.mark.parametrize("what,message", [
    ("odd-rows", "odd number of rows"),
    ("module-rank", "does not match the process group"),
])
def test_one_rank_error_stops_every_rank(workers, what, message):
    """One rank's bad argument: it raises its own error, the others say which rank failed."""
    results = workers(2).run(_disagreeing, what)
    assert isinstance(results[1], Raised) and message in results[1].message, results[1]
    assert isinstance(results[0], Raised) and "rank(s) [1]" in results[0].message, results[0]


def test_valid_labels_across_ranks(workers):
    results = all_ok(workers(2).run(_disagreeing, "labels"))
    assert all(torch.isfinite(r) for r in results)


def _silent_peer(rank, world):
    """Rank 1 never calls the loss: rank 0 must get an error once the group's timeout passes."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if rank == 1:
        return "skipped"
    x = torch.randn(3, 4)
    return fd.clip_loss(x, x, 2.0, group=group, backend="torch")


def test_missing_peer_times_out_instead_of_hanging(workers):
    results = workers(2).run(_silent_peer)
    assert results[1] == "skipped"
    assert isinstance(results[0], Raised), results[0]


def test_needs_a_process_group():
    x = torch.randn(3, 4)
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.clip_loss(x, x, 2.0)


# ---------------------------------------------------------------------------------------------
# open_clip's ClipLoss modes and DDP


def _open_clip_mode(rank, world, local_loss, gather_with_grad, seed):
    rows = [3, 3] if world == 2 else [2] * world
    batch = _global_batch("clip", rows, rows, 6, torch.float32, seed)
    i = _slice(batch["i"], rows, rank).clone().requires_grad_()
    t = _slice(batch["t"], rows, rank).clone().requires_grad_()
    scale = torch.tensor(5.0, requires_grad=True)
    loss_fn = fusedloss.ClipLoss(local_loss=local_loss, gather_with_grad=gather_with_grad,
                                 rank=rank, world_size=world, backend="torch")
    loss = loss_fn(i, t, scale)
    loss.backward()
    return loss.detach(), [i.grad, t.grad, scale.grad]


@pytest.mark.parametrize("local_loss,gather_with_grad", [(True, True), (False, True),
                                                         (False, False)])
def test_clip_loss_module_open_clip_modes(workers, local_loss, gather_with_grad):
    """What open_clip's ClipLoss gives each rank (b = 3 per rank, W = 2): the loss value, the
    feature gradients (W·∂L/∂f with gather_with_grad, else ∂L/∂f) and d logit_scale."""
    world, rows, seed = 2, [3, 3], 11
    results = all_ok(workers(world).run(_open_clip_mode, local_loss, gather_with_grad, seed))
    batch = _global_batch("clip", rows, rows, 6, torch.float32, seed)
    i, t = batch["i"].clone().requires_grad_(), batch["t"].clone().requires_grad_()
    scale = torch.tensor(5.0, requires_grad=True)
    total = fusedloss.clip_loss(i, t, scale, backend="torch", reduction="none")
    total.mean().backward()
    feature_factor = world if gather_with_grad else 1
    scale_grads = []
    for r, (loss, (gi, gt, gs)) in enumerate(results):
        want = total.detach()[3 * r:3 * r + 3].mean() if local_loss else total.detach().mean()
        torch.testing.assert_close(loss, want)
        torch.testing.assert_close(gi, feature_factor * i.grad[3 * r:3 * r + 3])
        torch.testing.assert_close(gt, feature_factor * t.grad[3 * r:3 * r + 3])
        scale_grads.append(gs)
    if local_loss:  # shares of W·∂L/∂s; DDP's average is ∂L/∂s
        torch.testing.assert_close(sum(scale_grads) / world, scale.grad)
    else:  # open_clip computes the whole loss on every rank: ∂L/∂s everywhere
        for gs in scale_grads:
            torch.testing.assert_close(gs, scale.grad)


class _TwoTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(5, 4)
        self.text = torch.nn.Linear(3, 4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(5.0)))

    def forward(self, x, y):
        return (F.normalize(self.image(x), dim=1), F.normalize(self.text(y), dim=1),
                self.logit_scale.exp())


def _two_tower_data(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    n = sum(rows)
    return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)


def _ddp_train(rank, world, rows, steps, kind, device="cpu"):
    """DDP training on every rank (``device="cuda"``: NCCL workers, the Triton kernels);
    returns the final parameters on the CPU."""
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    model = torch.nn.parallel.DistributedDataParallel(_TwoTower().to(dev))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    backend = "auto" if device == "cuda" else "torch"
    if kind == "clip":
        loss_fn = fusedloss.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank,
                                     world_size=world, backend=backend)
    else:
        loss_fn = fusedloss.SigLipLoss(rank=rank, world_size=world, backend=backend)
    bias = torch.tensor(-1.0, device=dev)
    for step in range(steps):
        x, y = (t.to(dev) for t in _two_tower_data(step, rows))
        img, txt, scale = model(_slice(x, rows, rank), _slice(y, rows, rank))
        args = (img, txt, scale) if kind == "clip" else (img, txt, scale, bias)
        loss = loss_fn(*args)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"))])
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_ddp_training_equals_one_process(workers, nccl_workers, kind, device):
    """Two ranks under DDP (gloo on the CPU, or NCCL on two GPUs), each with its half of every
    batch, train the same model as one process on the whole batch."""
    rows, steps = [4, 4], 3
    group = workers(2) if device == "cpu" else nccl_workers(2)
    states = all_ok(group.run(_ddp_train, rows, steps, kind, device))
    model = _TwoTower()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn = fusedloss.ClipLoss(backend="torch") if kind == "clip" else \
        fusedloss.SigLipLoss(backend="torch")
    for step in range(steps):
        x, y = _two_tower_data(step, rows)
        img, txt, scale = model(x, y)
        args = (img, txt, scale) if kind == "clip" else (img, txt, scale, torch.tensor(-1.0))
        loss = loss_fn(*args)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for key, want in model.state_dict().items():
        for rank, state in enumerate(states):
            # fp32 on the GPU: the Triton kernels and cuBLAS sum in other orders
            tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(state[key], want, **tol,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")


# ---------------------------------------------------------------------------------------------
# on a GPU: NCCL, the Triton kernels under the ring's block calls


def _nccl_case(rank, world, b, c):
    torch.manual_seed(0)
    dev = torch.device("cuda", rank)
    i = F.normalize(torch.randn(b, c, device=dev), dim=1).to(torch.bfloat16).requires_grad_()
    t = F.normalize(i.detach().float() + 0.5 * torch.randn(b, c, device=dev), dim=1)
    t = t.to(torch.bfloat16).requires_grad_()
    scale = torch.tensor(20.0, device=dev, requires_grad=True)
    out = {}
    for name, fn in (("ring", fd.clip_loss), ("one", fusedloss.clip_loss)):
        for x in (i, t, scale):
            x.grad = None
        loss = fn(i, t, scale)
        loss.backward()
        out[name] = [loss.detach().cpu()] + [x.grad.float().cpu() for x in (i, t, scale)]
    z = torch.cat([i, t]).detach().requires_grad_()
    for name, fn in (("nt_ring", fd.nt_xent_loss), ("nt_one", fusedloss.nt_xent_loss)):
        z.grad = None
        loss = fn(z, 0.2)
        loss.backward()
        out[name] = [loss.detach().cpu(), z.grad.float().cpu()]
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_world_of_one_equals_one_process():
    """World size 1 on NCCL (what one GPU allows): the ring's block calls with the Triton
    kernels, bf16 and filtering on, against the single-process loss."""
    workers = Workers(1, backend="nccl")
    try:
        out = all_ok(workers.run(_nccl_case, 4096, 256))[0]
    finally:
        workers.close()
    for on_ring, one in (("ring", "one"), ("nt_ring", "nt_one")):
        for got, want in zip(out[on_ring], out[one], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-5 * want.abs().max())


def _compiled_case(rank, world, seed, kind, backend):
    rows = [3, 4]
    batch = _global_batch("clip", rows, rows, 6, torch.float32, seed)
    i = _slice(batch["i"], rows, rank).clone().requires_grad_()
    t = _slice(batch["t"], rows, rank).clone().requires_grad_()
    scale = torch.tensor(4.0, requires_grad=True)
    bias = torch.tensor(-1.0, requires_grad=True)
    leaves = (i, t, scale, bias) if kind == "siglip" else (i, t, scale)

    def step(i, t, scale, bias=None):
        i, t = torch.tanh(i), t * 2
        if kind == "siglip":  # on the Triton backend: its gradients formed in the forward's tour
            return fd.siglip_loss(i, t, scale, bias, backend=backend) * 3
        return fd.clip_loss(i, t, scale, backend=backend) * 3

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")
    out = []
    for fn in (step, compiled):
        loss = fn(*leaves)
        grads = torch.autograd.grad(loss, leaves)
        out.append((loss.detach(), grads))
    return out


@pytest.mark.parametrize("kind, backend", [("clip", "torch"), ("siglip", "triton")])
def test_ring_inside_torch_compile(workers, kind, backend):
    """Under torch.compile the ring runs eagerly (a graph break around it), with the same
    values and gradients as without compile (an upstream gradient of 3 on every rank)."""
    if backend not in RING_BACKENDS:
        pytest.skip("the workers' CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    for (loss, grads), (c_loss, c_grads) in all_ok(
            workers(2).run(_compiled_case, 4, kind, backend)):
        torch.testing.assert_close(c_loss, loss)
        for g, cg in zip(grads, c_grads, strict=True):
            torch.testing.assert_close(cg, g)


def _nccl_ring_case(rank, world, b, c):
    """Every rank builds the global batch (same seed), runs the ring on its slice and returns
    its loss and gradients; rank 0 also runs one process on the whole batch."""
    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(0)
    images = F.normalize(torch.randn(world * b, c, device=dev, generator=g), dim=1)
    texts = F.normalize(images + 0.5 * torch.randn(world * b, c, device=dev, generator=g), dim=1)
    images, texts = images.to(torch.bfloat16), texts.to(torch.bfloat16)
    mine = slice(rank * b, (rank + 1) * b)
    i = images[mine].clone().requires_grad_()
    t = texts[mine].clone().requires_grad_()
    scale = torch.tensor(20.0, device=dev, requires_grad=True)
    loss = fd.clip_loss(i, t, scale)
    loss.backward()
    out = {"ring": [loss.detach().cpu(), i.grad.float().cpu(), t.grad.float().cpu(),
                    scale.grad.cpu()]}
    # Again with the exchange of facts through NCCL, as for a group too large for the store's.
    import fusedloss.ops._group as group_module

    with mock.patch.object(group_module, "STORE_EXCHANGE_MAX_WORLD", 1):
        i.grad = t.grad = scale.grad = None
        loss = fd.clip_loss(i, t, scale)
        loss.backward()
    out["nccl exchange"] = [loss.detach().cpu(), i.grad.float().cpu(), t.grad.float().cpu(),
                            scale.grad.cpu()]
    if rank == 0:
        i1, t1 = images.clone().requires_grad_(), texts.clone().requires_grad_()
        s1 = torch.tensor(20.0, device=dev, requires_grad=True)
        one = fusedloss.clip_loss(i1, t1, s1)
        one.backward()
        out["one"] = [one.detach().cpu(), i1.grad.float().cpu(), t1.grad.float().cpu(),
                      s1.grad.cpu()]
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_ring_on_two_gpus():
    """The ring over NCCL on two GPUs (real P2P transfers, Triton kernels, bf16, filtering on)
    against one process on the whole batch; its exchange of facts through the store or through
    NCCL (a group too large for the store's) gives the same results bit for bit."""
    workers = Workers(2, backend="nccl")
    try:
        results = all_ok(workers.run(_nccl_ring_case, 4096, 256))
    finally:
        workers.close()
    for per_rank in results:
        for got, want in zip(per_rank["nccl exchange"], per_rank["ring"], strict=True):
            assert torch.equal(got, want)
    loss1, di, dt, ds = results[0]["one"]
    world, b = 2, 4096
    mean = (results[0]["ring"][0] + results[1]["ring"][0]) / world
    torch.testing.assert_close(mean, loss1, rtol=1e-4, atol=1e-4)
    for r in range(world):
        _, gi, gt, _ = results[r]["ring"]
        rows = slice(r * b, (r + 1) * b)
        for got, want in ((gi, world * di[rows]), (gt, world * dt[rows])):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max())
    total_ds = results[0]["ring"][3] + results[1]["ring"][3]
    torch.testing.assert_close(total_ds, world * ds, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# the merge of two partial statistics (the ring's travelling column statistics)


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=pytest.mark.skipif(
        not can_run_triton(), reason="needs a GPU or the Triton interpreter"))])
@given(n=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_merge_stats_matches_float64(backend, n, seed):
    """engine.merge_stats of two (max, Σ exp) partials equals the float64 log-sum-exp of their
    union; a partial without entries (sum 0, max 0 as the forward reports it) counts as none,
    so rows far below 0 are not swamped; NaN stays NaN; the output may alias an input."""
    from fusedloss.core import engine

    gen = torch.Generator().manual_seed(seed)
    device = DEVICE if backend == "triton" else "cpu"
    values = [torch.randn(n, 7, generator=gen, dtype=torch.float64) * 30 - 200 for _ in "xy"]
    empty = torch.rand(n, generator=gen) < 0.2  # rows whose x partial has no entries
    packed = []
    for k, v in enumerate(values):
        top = v.amax(1)
        total = torch.exp(v - top[:, None]).sum(1)
        if k == 0:
            top, total = torch.where(empty, 0.0, top), torch.where(empty, 0.0, total)
        packed.append(torch.stack((top, total)).float().to(device))
    packed[1][1, -1] = float("nan")  # a NaN row
    expected = torch.logsumexp(torch.where(empty[:, None], float("-inf"), values[0]), 1)
    expected = torch.logaddexp(expected, torch.logsumexp(values[1], 1))
    expected[-1] = float("nan")
    x = packed[0].clone()
    out = engine.merge_stats(x, packed[1], out=x, backend=backend).cpu().double()
    got = out[0] + torch.log(out[1])
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    finite = ~torch.isnan(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# CUDA graphs: a call during a capture reuses the last eager call's exchange of facts


class _PretendCapturing:
    """Makes the distributed layer see a CUDA graph capture in progress (on the CPU, where none
    can be), and any all-gather fail: a captured call must not communicate its facts."""

    def __enter__(self):
        import fusedloss.ops._group as group_module

        self.saved = [(group_module, "capturing", group_module.capturing),
                      (dist, "all_gather", dist.all_gather)]
        group_module.capturing = lambda device: True

        def no_all_gather(*args, **kwargs):
            raise AssertionError("a captured call exchanged its facts")

        dist.all_gather = no_all_gather
        return self

    def __exit__(self, *exc):
        for module, name, value in self.saved:
            setattr(module, name, value)


def _error_of(fn):
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _captured_calls(rank, world):
    """An eager call, then the same call and others as if during a CUDA graph capture."""
    g = torch.Generator().manual_seed(rank)
    i, t = (torch.randn(5 + rank, 16, generator=g).requires_grad_() for _ in range(2))
    scale = torch.tensor(10.0, requires_grad=True)

    def call(rows=None, **kwargs):
        loss = fd.clip_loss(i[:rows], t[:rows], scale, **kwargs)
        return [loss.detach(), *torch.autograd.grad(loss, (i, t, scale))]

    eager = call()
    vocab = torch.randn(7, 16, generator=g)
    fd.nt_xent_loss(i[:4], 0.5)  # an eager NT-Xent call with a float temperature
    with _PretendCapturing():
        captured = call()
        errors = {
            "new shapes": _error_of(lambda: call(rows=-1)),
            "new options": _error_of(lambda: call(reduction="sum")),
            "labels": _error_of(lambda: fd.info_nce_loss(i, t, torch.arange(i.shape[0]))),
            "tensor temperature": _error_of(lambda: fd.nt_xent_loss(i[:4], torch.tensor(0.5))),
            "torch backend": _error_of(lambda: call(backend="torch")),
            "lm head": _error_of(lambda: fd.vocab_parallel_cross_entropy(
                i.detach(), vocab, torch.zeros(i.shape[0], dtype=torch.long))),
        }
        nt_xent = _error_of(lambda: fd.nt_xent_loss(i[:4], 0.5))
    return eager, captured, errors, nt_xent


def test_a_call_during_a_cuda_graph_capture_reuses_the_eager_exchange(workers):
    """During a capture the host cannot read the exchange's all-gather: a call with the
    arguments of an earlier eager call reuses what that call found (and gives its results),
    without communicating; any other call, and a call that reads input values on the host,
    raises naming what to do (on every rank alike, before any transfer)."""
    for eager, captured, errors, nt_xent in all_ok(workers(3).run(_captured_calls)):
        for got, want in zip(captured, eager, strict=True):
            assert torch.equal(got, want)
        assert nt_xent is None
        assert "no eager call on this rank" in errors["new shapes"]
        assert "no eager call on this rank" in errors["new options"]
        assert "labels=None" in errors["labels"]
        assert errors["tensor temperature"] is None  # not read on the host: capturable
        assert "backend='torch'" in errors["torch backend"]
        assert "call it outside the capture" in errors["lm head"]


def _nccl_graph_case(rank, world, b, c):
    """The ring's forward and backward captured in a CUDA graph (after an eager call) and
    replayed on new inputs, against eager calls on the same inputs."""
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    g = torch.Generator(device=dev).manual_seed(rank)

    def features():
        return F.normalize(torch.randn(b, c, device=dev, generator=g), dim=1).bfloat16()

    i, t = features().requires_grad_(), features().requires_grad_()
    scale = torch.tensor(20.0, device=dev, requires_grad=True)

    def step():
        loss = fd.clip_loss(i, t, scale)
        return [loss.detach().clone(), *torch.autograd.grad(loss, (i, t, scale))]

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks, and the eager exchange
        for _ in range(2):
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    out = []
    for _ in range(2):
        new = [features(), features()]
        with torch.no_grad():
            i.copy_(new[0])
            t.copy_(new[1])
        eager = step()
        graph.replay()
        torch.cuda.synchronize(dev)
        out.append(([x.float().cpu() for x in eager], [x.float().cpu() for x in static]))
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_ring_replayed_as_a_cuda_graph():
    """The ring captured in a CUDA graph (its NCCL transfers inside) gives, replayed on new
    inputs, what eager calls give, bit for bit."""
    workers = Workers(2, backend="nccl")
    try:
        results = all_ok(workers.run(_nccl_graph_case, 4096, 256))
    finally:
        workers.close()
    for per_rank in results:
        for eager, replayed in per_rank:
            for want, got in zip(eager, replayed, strict=True):
                assert torch.equal(got, want)


def _nccl_replay_case(rank, world, b, c):
    """Each loss on the ring four times on new inputs, replayed (its graphs captured at the
    second call) on rank 0 and direct on the others, against direct calls on every rank on
    the same inputs: (kind, call, replayed values, direct values) per call; and how many
    graphs rank 0 holds."""
    from fusedloss.core import config, replay

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    replay.clear()
    g = torch.Generator(device=dev).manual_seed(rank)
    mine = {} if rank == 0 else {"replay_work": 0}
    out = []

    def features(rows):
        return F.normalize(torch.randn(rows, c, device=dev, generator=g), dim=1).bfloat16()

    def run(kind, x, y, scale, bias):
        x, y = x.clone().requires_grad_(), y.clone().requires_grad_()
        s = scale.clone().requires_grad_()
        leaves = (x, y, s) if kind != "nt_xent" else (x, s)
        if kind == "clip":
            loss = fd.clip_loss(x, y, s)
        elif kind == "siglip":
            bias = bias.clone().requires_grad_()
            leaves = (*leaves, bias)
            loss = fd.siglip_loss(x, y, s, bias)
        elif kind == "info_nce":
            loss = fd.info_nce_loss(x, y, temperature=s)
        else:
            loss = fd.nt_xent_loss(x, s)
        return [loss.detach().cpu(), *(t.float().cpu() for t in torch.autograd.grad(
            loss * 3.0, leaves))]

    for kind in ("clip", "siglip", "info_nce", "nt_xent"):
        scale = torch.tensor(0.1 if kind in ("info_nce", "nt_xent") else 20.0, device=dev)
        bias = torch.tensor(-10.0, device=dev)
        for call in range(4):
            x, y = features(b), features(2 * b if kind == "info_nce" else b)
            with config.tuned(**mine):
                replayed = run(kind, x, y, scale, bias)
            with config.tuned(replay_work=0):
                direct = run(kind, x, y, scale, bias)
            out.append((kind, call, replayed, direct))
    return out, len(replay._CACHE)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_ring_replays_its_launches_between_its_transfers():
    """A small ring replays its launches as CUDA graphs, its transfers posted between them on
    the host: every loss, from its capture on, gives what a direct call gives, bit for bit,
    also where one rank replays and the other does not; and the group is destroyed afterwards
    without waiting on the graphs (a worker that does not leave is killed and listed)."""
    workers = Workers(2, backend="nccl")
    try:
        results = all_ok(workers.run(_nccl_replay_case, 2048, 128))
    finally:
        workers.close()
    assert workers.killed == []
    assert results[0][1] > 0 and results[1][1] == 0  # rank 0 holds graphs, rank 1 none
    for per_rank, _ in results:
        for kind, call, replayed, direct in per_rank:
            for got, want in zip(replayed, direct, strict=True):
                assert torch.equal(got, want), (kind, call)


# ---------------------------------------------------------------------------------------------
# the exchange of facts on an NCCL group goes through the store


def _exchange_as_if_nccl(rank, world):
    """Exchanges through WORLD and through a group of ranks 0 and 2, both seen as NCCL groups
    (any all-gather fails); returns the layouts and which of the store's keys remain."""
    import fusedloss.ops._group as group_module

    sub = dist.new_group([0, 2])  # every rank makes it, as torch.distributed asks

    def no_all_gather(*args, **kwargs):
        raise AssertionError("an NCCL group's facts went through an all-gather")

    cpu = torch.device("cpu")
    with (mock.patch.object(dist, "get_backend", lambda group=None: "nccl"),
          mock.patch.object(dist, "all_gather", no_all_gather)):
        layouts = [group_module.exchange(None, 3 + rank, 1, {}, cpu)[0]]
        if rank != 1:  # only the group's ranks take part, rank 1 goes on
            for i in range(3):
                layouts.append(group_module.exchange(sub, 5 + rank + i, 2, {}, cpu)[0])
        try:
            found = group_module.exchange(None, 1, 1, {"reduction": (rank % 2, "…")}, cpu,
                                          extra=(rank, 10 * rank))
            facts = None
        except ValueError as e:
            found, facts = None, str(e)
    store = dist.distributed_c10d._get_default_store()
    tag = hashlib.sha1(b"0,2").hexdigest()[:16]
    kept = [n for n in range(3)
            if rank != 1 and store.check([f"fusedloss/exchange/{tag}/{n}/{rank}"])]
    return [(layout.rank, layout.rows) for layout in layouts], kept, found, facts


def _exchange_of_a_large_nccl_group(rank, world):
    """An exchange through WORLD seen as an NCCL group larger than the store's limit: which
    path it took (the NCCL all-gather replaced by a gloo one, the store's read made to fail)."""
    import fusedloss.ops._group as group_module

    taken = []

    def through_nccl(local, world, group, device):
        taken.append("nccl")
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=group)
        return torch.stack(gathered).tolist()

    def through_store(*args):
        raise AssertionError("a group beyond STORE_EXCHANGE_MAX_WORLD used the store")

    with (mock.patch.object(dist, "get_backend", lambda group=None: "nccl"),
          mock.patch.object(group_module, "STORE_EXCHANGE_MAX_WORLD", world - 1),
          mock.patch.object(group_module, "_gather_on_side_stream", through_nccl),
          mock.patch.object(group_module, "_store_all_gather", through_store)):
        layout, _ = group_module.exchange(None, 3 + rank, 1, {}, torch.device("cpu"))
    return taken, layout.rows


def test_a_large_nccl_groups_exchange_goes_through_nccl(workers):
    """Every rank reads every rank's key from the one store server (world² reads a call):
    beyond ``STORE_EXCHANGE_MAX_WORLD`` ranks the exchange all-gathers through NCCL."""
    for taken, rows in all_ok(workers(3).run(_exchange_of_a_large_nccl_group)):
        assert taken == ["nccl"] and rows == (3, 4, 5)


def test_an_nccl_groups_exchange_goes_through_the_store(workers):
    """NCCL runs a communicator's operations in order, so an all-gather of the facts through
    the ring's NCCL group would wait for the previous step's transfers, and with them for that
    step's kernels: the exchange goes through the process group's store instead, for WORLD and
    for a group of some ranks (0 and 2, while rank 1 goes on), its keys deleted two rounds
    later, a disagreement still named on every rank."""
    results = all_ok(workers(3).run(_exchange_as_if_nccl))
    for rank, (layouts, kept, found, facts) in enumerate(results):
        assert layouts[0] == (rank, (3, 4, 5))
        if rank != 1:
            assert layouts[1:] == [(rank // 2, (5 + i, 7 + i)) for i in range(3)]
            assert kept == [1, 2]  # the third round deleted the first one's key
        assert found is None and "the ranks disagree on reduction" in facts
