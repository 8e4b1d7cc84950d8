"""The vocabulary-parallel LM head on gloo process groups of 1–3 CPU processes.

Every rank holds the same hidden states and targets and its rows of the classifier; its loss,
LSE, d input (the full one) and the gradients of its shard must equal the single-process head
on the whole weight (the same backend and dtype), sliced to the shard. Hypothesis draws the
shards (uneven), the tokens and every option.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers import counting_training_path
from hypothesis import given, settings
from hypothesis import strategies as st
from workers import NCCL_EXAMPLES, Raised, all_ok

import fusedloss

BACKENDS = ("torch", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("torch",)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IGNORE = -100



def _problem(case):
    """The whole head's inputs (the same on every process, from the seed)."""
    g = torch.Generator().manual_seed(case["seed"])
    v, d, (b, t) = sum(case["shards"]), case["d"], case["tokens"]
    dtype = DTYPES[case["dtype"]]
    hidden = torch.randn(b, t, d, generator=g).to(dtype)
    weight = (torch.randn(v, d, generator=g) / d**0.5 * 3).to(dtype)
    bias = torch.randn(v, generator=g).to(dtype)
    class_weight = torch.rand(v, generator=g) + 0.5
    target = torch.randint(0, v, (b, t), generator=g)
    target[torch.rand(b, t, generator=g) < case["ignored"]] = IGNORE
    return hidden, weight, bias, class_weight, target


def _options(case, bias, class_weight):
    opts = dict(reduction=case["reduction"], label_smoothing=case["label_smoothing"],
                z_loss=case["z_loss"], softcap=case["softcap"], shift=case["shift"],
                return_lse=case.get("return_lse", True), backend=case["backend"],
                ignore_index=IGNORE, filter_eps=None)
    if case["bias"]:
        opts["linear_bias"] = bias
    if case["class_weight"]:
        opts["weight"] = class_weight
    return opts


def _upstream(loss, lse):
    """A backward through both outputs, with uneven weights on the per-token values (without
    the LSE: the loss scaled, so that its upstream gradient is not 1)."""
    if loss.dim():
        w = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).view(loss.shape)
        return (loss * w).sum() + (0.0 if lse is None else 0.1 * (lse * w).sum())
    return 0.75 * loss if lse is None else loss + 0.1 * lse.sum()


def _shard_case(rank, world, case, device="cpu"):
    """On every rank: the sharded head, backward; the results on the CPU. ``device="cuda"``:
    each rank's tensors on its GPU (NCCL workers)."""
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    hidden, weight, bias, class_weight, target = (t.to(dev) for t in _problem(case))
    starts = case.get("starts") or [sum(case["shards"][:r]) for r in range(world)]
    lo, hi = starts[rank], starts[rank] + case["shards"][rank]
    h = hidden.clone().requires_grad_()
    w = weight[lo:hi].clone().requires_grad_()
    b = bias[lo:hi].clone().requires_grad_()
    opts = _options(case, b, class_weight[lo:hi])
    if case.get("vocab_order") == "permuted" or (case.get("vocab_order") == "rank 1"
                                                  and rank == 1):  # the shard's tiles reordered
        g = torch.Generator().manual_seed(case["seed"] + rank)
        opts["vocab_order"] = torch.randperm(hi - lo, generator=g).to(dev)
    loss, lse = _with_lse(case, fusedloss.linear_cross_entropy(
        h, w, target, process_group=dist.group.WORLD,
        vocab_start=lo if case.get("starts") else None, **opts))
    _upstream(loss, lse).backward()
    return tuple(None if t is None else t.detach().cpu() for t in (
        loss, lse, h.grad, w.grad, b.grad if case["bias"] else None))


def _with_lse(case, out):
    """(loss, lse) of a call, lse None where the case asks for the loss alone."""
    return out if case.get("return_lse", True) else (out, None)


def _check(case, results):
    hidden, weight, bias, class_weight, target = _problem(case)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    loss, lse = _with_lse(case, fusedloss.linear_cross_entropy(
        h, w, target, **_options(case, b, class_weight)))
    _upstream(loss, lse).backward()
    world = len(case["shards"])
    starts = case.get("starts") or [sum(case["shards"][:r]) for r in range(world)]
    fp32 = case["dtype"] == "fp32"
    value_tol = dict(rtol=1e-5, atol=1e-5) if fp32 else dict(rtol=1e-3, atol=1e-3)
    for r, (r_loss, r_lse, r_dh, r_dw, r_db) in enumerate(results):
        lo, hi = starts[r], starts[r] + case["shards"][r]
        torch.testing.assert_close(r_loss, loss.detach(), **value_tol)
        if lse is not None:
            torch.testing.assert_close(r_lse, lse.detach(), **value_tol)
        for name, got, want in (("d input", r_dh, h.grad), ("d weight", r_dw, w.grad[lo:hi]),
                                ("d bias", r_db, b.grad[lo:hi] if case["bias"] else None)):
            if want is None:
                continue
            # Sums of terms of either sign in another order (a few ulps of the terms); bf16:
            # dX rounded to bf16 before the matmuls on both sides, the shards' combined
            # statistics may flip a rounding.
            scale = max([1.0, *want.float().abs().flatten().tolist()])
            tol = dict(rtol=2e-5, atol=2e-5 * scale) if fp32 else dict(rtol=2e-2,
                                                                       atol=2e-2 * scale)
            torch.testing.assert_close(got.float(), want.float(), **tol,
                                       msg=lambda m, r=r, n=name: f"rank {r} {n}: {m}")


@st.composite
def head_cases(draw, backends=BACKENDS, max_world=3):
    world = draw(st.integers(1, max_world))
    return dict(
        shards=draw(st.lists(st.integers(1, 9), min_size=world, max_size=world)),
        tokens=(draw(st.integers(1, 3)), draw(st.integers(1, 5))),
        d=draw(st.integers(1, 8)), dtype=draw(st.sampled_from(sorted(DTYPES))),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1])),
        z_loss=draw(st.sampled_from([0.0, 1e-2])),
        softcap=draw(st.sampled_from([None, 3.0])),
        shift=draw(st.booleans()), bias=draw(st.booleans()),
        class_weight=draw(st.booleans()), ignored=draw(st.sampled_from([0.0, 0.3, 1.0])),
        backend=draw(st.sampled_from(backends)), seed=draw(st.integers(0, 2**16)),
        vocab_order=draw(st.sampled_from([None, "permuted"])),
    )


@given(case=head_cases())
def test_sharded_head_equals_whole_head(workers, case):
    results = all_ok(workers(len(case["shards"])).run(_shard_case, case))
    _check(case, results)


NCCL_WORLD = min(torch.cuda.device_count(), 3)


@pytest.mark.skipif(NCCL_WORLD < 2, reason="needs two or more CUDA GPUs")
@settings(max_examples=NCCL_EXAMPLES)
@given(case=head_cases(backends=("triton", "torch"), max_world=max(NCCL_WORLD, 1)))
def test_sharded_head_on_nccl_equals_whole_head(nccl_workers, case):
    """The same property over NCCL, one process per GPU; the reference: one process on the
    CPU with the torch backend."""
    results = all_ok(nccl_workers(len(case["shards"])).run(_shard_case, case, "cuda"))
    _check(dict(case, backend="torch"), results)


def test_explicit_vocab_start(workers):
    """Shards given out of rank order: rank 0 holds the last rows."""
    case = dict(shards=[4, 6], starts=[6, 0], tokens=(2, 4), d=5, dtype="fp32",
                reduction="mean", label_smoothing=0.1, z_loss=0.0, softcap=None, shift=True,
                bias=True, class_weight=True, ignored=0.2, backend="torch", seed=3)
    results = all_ok(workers(2).run(_shard_case, case))
    _check(case, results)


# ---------------------------------------------------------------------------------------------
# the training path: a reduced loss with gradients on the Triton backend


def _training_case(rank, world, case, device="cpu"):
    """``_shard_case`` in chunks of ``case["chunk"]`` rows (None: the policy's), counting the
    calls of the training path's row-statistics launcher (one per chunk)."""
    with counting_training_path("shard_row_stats", case["chunk"]) as calls:
        results = _shard_case(rank, world, case, device)
    return len(calls), results


_TRAINING = dict(backend="triton", return_lse=False, ignored=0.3, vocab_order=None)
TRAINING_CASES = [
    # rank 0 holds the last rows (vocab_start given)
    dict(_TRAINING, shards=[5, 9], starts=[9, 0], tokens=(2, 8), d=6, dtype="fp32",
         reduction="mean", label_smoothing=0.1, z_loss=1e-2, softcap=None, shift=True,
         bias=True, class_weight=True, seed=1, chunk=7),
    dict(_TRAINING, shards=[4, 1, 7], tokens=(3, 5), d=5, dtype="bf16", reduction="sum",
         label_smoothing=0.0, z_loss=1e-2, softcap=3.0, shift=False, bias=True,
         class_weight=False, seed=2, chunk=7),
    dict(_TRAINING, shards=[6, 3], tokens=(2, 5), d=4, dtype="bf16", reduction="mean",
         label_smoothing=0.1, z_loss=0.0, softcap=3.0, shift=True, bias=False,
         class_weight=True, seed=3, chunk=None),
    dict(_TRAINING, shards=[3, 5, 2, 4], tokens=(1, 9), d=3, dtype="fp32", reduction="sum",
         label_smoothing=0.1, z_loss=0.0, softcap=None, shift=False, bias=False,
         class_weight=True, seed=4, chunk=4),
    # every token ignored: a loss of 0 and zero gradients
    dict(_TRAINING, shards=[3, 4], tokens=(2, 3), d=4, dtype="fp32", reduction="mean",
         label_smoothing=0.1, z_loss=1e-2, softcap=None, shift=False, bias=True,
         class_weight=False, seed=5, chunk=4, ignored=1.0),
]


def _training_id(case):
    return (f"K{len(case['shards'])}-{case['dtype']}-{case['reduction']}"
            f"-chunk{case['chunk']}-seed{case['seed']}")


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton kernels need TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", [pytest.param(c, id=_training_id(c)) for c in TRAINING_CASES])
def test_training_path_equals_whole_head(workers, case):
    """A reduced loss with gradients takes the training path on every rank, in chunks of rows
    (one row-statistics launch per chunk), and gives the single-process head's loss and
    gradients (dE on every rank, each rank's dC and dbias shard), the backward scaled by the
    loss's upstream gradient."""
    results = all_ok(workers(len(case["shards"])).run(_training_case, case))
    n = case["tokens"][0] * case["tokens"][1]
    chunks = -(-n // (case["chunk"] or n))
    assert [calls for calls, _ in results] == [chunks] * len(results)
    _check(case, [result for _, result in results])


@pytest.mark.skipif(NCCL_WORLD < 2, reason="needs two or more CUDA GPUs")
@pytest.mark.parametrize("case", [pytest.param(c, id=_training_id(c)) for c in TRAINING_CASES
                                  if len(c["shards"]) <= NCCL_WORLD])
def test_training_path_on_nccl_equals_whole_head(nccl_workers, case):
    """The same over NCCL, one process per GPU; the reference: one process on the CPU with the
    torch backend."""
    results = all_ok(nccl_workers(len(case["shards"])).run(_training_case, case, "cuda"))
    n = case["tokens"][0] * case["tokens"][1]
    assert [calls for calls, _ in results] == [-(-n // (case["chunk"] or n))] * len(results)
    _check(dict(case, backend="torch"), [result for _, result in results])


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton kernels need TRITON_INTERPRET=1")
@pytest.mark.parametrize("change", ["return_lse", "none", "vocab_order on rank 1"])
def test_training_path_only_where_every_rank_can(workers, change):
    """The per-token loss, the LSE, or a vocab_order on one rank only: the engine on every rank
    (the two paths' collectives differ), with the same results."""
    case = dict(TRAINING_CASES[1], chunk=7)
    if change == "return_lse":
        case["return_lse"] = True
    elif change == "none":
        case["reduction"] = "none"
    else:
        case["vocab_order"] = "rank 1"
    results = all_ok(workers(len(case["shards"])).run(_training_case, case))
    assert [calls for calls, _ in results] == [0] * len(results)
    _check(case, [result for _, result in results])


def _out_of_range_training(rank, world):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 4, generator=g).requires_grad_()
    w = torch.randn(5, 4, generator=g).requires_grad_()
    y = torch.randint(0, 5 * world, (2, 3), generator=g)
    y[1, 2] = -3
    return fusedloss.linear_cross_entropy(h, w, y, process_group=dist.group.WORLD,
                                          backend="triton")


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton kernels need TRITON_INTERPRET=1")
def test_training_path_out_of_range_target_raises_on_every_rank(workers):
    """The training path raises once its work is queued (no read-back before it), on every
    rank."""
    for rank, r in enumerate(workers(2).run(_out_of_range_training)):
        assert isinstance(r, Raised), f"rank {rank} did not raise"
        assert "target holds -3, outside [0, V) = [0, 10)" in r.message, (rank, r.message)


# ---------------------------------------------------------------------------------------------
# errors on every rank


def _bad_call(rank, world, what):
    d = 4
    h = torch.randn(2, 3, d)
    w = torch.randn(5, d)
    y = torch.randint(0, 5 * world, (2, 3))
    kw = {}
    if what == "tokens" and rank == 1:
        h, y = torch.randn(2, 4, d), torch.randint(0, 10, (2, 4))
    if what == "label_smoothing":
        kw["label_smoothing"] = 0.1 * rank
    if what == "target":
        y[0, 0] = 5 * world  # V = 5·world: one past the end, on every rank
    if what == "vocab_start-some":
        kw["vocab_start"] = 0 if rank == 0 else None
    if what == "vocab_start-overlap":
        kw["vocab_start"] = 0
    if what == "width" and rank == 1:
        w = torch.randn(5, d + 1)
    kw.setdefault("vocab_start", None)
    return fusedloss.linear_cross_entropy(h, w, y, process_group=dist.group.WORLD,
                                          backend="torch", **kw)


@pytest.mark.parametrize("what,message", [
    ("tokens", "the number of tokens"),
    ("label_smoothing", "label_smoothing"),
    ("target", "outside [0, V) = [0, 10)"),
    ("vocab_start-some", "vocab_start must be given on every rank or on none"),
    ("vocab_start-overlap", "must tile [0, V)"),
])
def test_errors_on_every_rank(workers, what, message):
    results = workers(2).run(_bad_call, what)
    for rank, r in enumerate(results):
        assert isinstance(r, Raised), f"rank {rank} did not raise"
        assert message in r.message, (rank, r.message)


def test_one_rank_shape_error_stops_every_rank(workers):
    results = workers(2).run(_bad_call, "width")
    assert isinstance(results[1], Raised) and "input must be (*, D)" in results[1].message
    assert isinstance(results[0], Raised) and "rank(s) [1]" in results[0].message


# ---------------------------------------------------------------------------------------------
# training: a tiny LM whose head is sharded over two ranks


class _TinyLM(torch.nn.Module):
    def __init__(self, vocab, d, rows=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, d)
        self.mix = torch.nn.Linear(d, d)
        head = torch.randn(vocab, d) / d**0.5
        self.head = torch.nn.Parameter(head if rows is None else head[rows].clone())

    def hidden(self, tokens):
        return torch.tanh(self.mix(self.embed(tokens)))


def _batch(step, vocab):
    return torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(step))


def _train_sharded(rank, world, vocab, steps):
    shard = vocab // world
    rows = slice(rank * shard, (rank + 1) * shard)
    model = _TinyLM(vocab, 8, rows)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn = fusedloss.LinearCrossEntropyLoss(shift=True, backend="torch",
                                               process_group=dist.group.WORLD)
    for step in range(steps):
        tokens = _batch(step, vocab)
        loss = loss_fn(model.hidden(tokens), model.head, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sharded_head_trains_like_one_process(workers):
    vocab, steps, world = 12, 3, 2
    states = all_ok(workers(world).run(_train_sharded, vocab, steps))
    model = _TinyLM(vocab, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn = fusedloss.LinearCrossEntropyLoss(shift=True, backend="torch")
    for step in range(steps):
        tokens = _batch(step, vocab)
        loss = loss_fn(model.hidden(tokens), model.head, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
    want = model.state_dict()
    shard = vocab // world
    for r, state in enumerate(states):
        for key in ("embed.weight", "mix.weight", "mix.bias"):
            torch.testing.assert_close(state[key], want[key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state["head"], want["head"][r * shard:(r + 1) * shard],
                                   rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Token log-probabilities and entropies over the sharded head (linear_log_probs)


def _log_probs_case(rank, world, case):
    """On every rank: log-probs and entropies of the sharded head, backward; CPU results."""
    hidden, weight, bias, _, target = _problem(case)
    starts = [sum(case["shards"][:r]) for r in range(world)]
    lo, hi = starts[rank], starts[rank] + case["shards"][rank]
    h = hidden.clone().requires_grad_()
    w = weight[lo:hi].clone().requires_grad_()
    b = bias[lo:hi].clone().requires_grad_() if case["bias"] else None
    logp, ent = fusedloss.linear_log_probs(
        h, w, target, linear_bias=b, temperature=case["temperature"], softcap=case["softcap"],
        shift=case["shift"], ignore_index=IGNORE, return_entropy=True, backend=case["backend"],
        process_group=dist.group.WORLD)
    _log_probs_upstream(logp, ent).backward()
    return tuple(None if t is None else t.detach() for t in (
        logp, ent, h.grad, w.grad, b.grad if b is not None else None))


def _log_probs_upstream(logp, ent):
    w = torch.linspace(-1.0, 1.5, logp.numel()).view(logp.shape)
    return (logp * w).sum() + 0.3 * (ent * w.flip(-1)).sum()


@st.composite
def log_probs_cases(draw):
    world = draw(st.integers(1, 3))
    return dict(
        shards=draw(st.lists(st.integers(1, 9), min_size=world, max_size=world)),
        tokens=(draw(st.integers(1, 3)), draw(st.integers(2, 5))), d=draw(st.integers(1, 8)),
        dtype="fp32", temperature=draw(st.sampled_from([1.0, 0.7])),
        softcap=draw(st.sampled_from([None, 3.0])), shift=draw(st.booleans()),
        bias=draw(st.booleans()), ignored=draw(st.sampled_from([0.0, 0.3, 1.0])),
        backend=draw(st.sampled_from(BACKENDS)), seed=draw(st.integers(0, 2**16)))


@given(case=log_probs_cases())
def test_sharded_log_probs_equal_whole_head(workers, case):
    results = all_ok(workers(len(case["shards"])).run(_log_probs_case, case))
    hidden, weight, bias, _, target = _problem(case)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if case["bias"] else None
    logp, ent = fusedloss.linear_log_probs(
        h, w, target, linear_bias=b, temperature=case["temperature"], softcap=case["softcap"],
        shift=case["shift"], ignore_index=IGNORE, return_entropy=True, backend=case["backend"])
    _log_probs_upstream(logp, ent).backward()
    starts = [sum(case["shards"][:r]) for r in range(len(case["shards"]))]
    for r, (r_logp, r_ent, r_dh, r_dw, r_db) in enumerate(results):
        lo, hi = starts[r], starts[r] + case["shards"][r]
        torch.testing.assert_close(r_logp, logp.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r_ent, ent.detach(), rtol=1e-5, atol=1e-5)
        for name, got, want in (("d input", r_dh, h.grad), ("d weight", r_dw, w.grad[lo:hi]),
                                ("d bias", r_db, b.grad[lo:hi] if b is not None else None)):
            if want is None:
                continue
            scale = max([1.0, *want.abs().flatten().tolist()])
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * scale,
                                       msg=lambda m, r=r, n=name: f"rank {r} {n}: {m}")


def _log_probs_disagree(rank, world):
    """Rank 1 asks for another temperature: every rank raises, naming the argument."""
    h = torch.randn(4, 3)
    w = torch.randn(5, 3)
    return fusedloss.linear_log_probs(h, w, torch.randint(0, 5 * world, (4,)),
                                      temperature=1.0 if rank == 0 else 0.5,
                                      process_group=dist.group.WORLD)


def test_sharded_log_probs_errors_on_every_rank(workers):
    results = workers(2).run(_log_probs_disagree)
    assert all(isinstance(r, Raised) and "temperature" in r.message for r in results), results


def _log_probs_compiled(rank, world):
    """The sharded log-probs inside a compiled function (a graph break there) equal eager."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 4, generator=g).requires_grad_()
    w = torch.randn(5 * world, 4, generator=g)[5 * rank:5 * rank + 5].clone().requires_grad_()
    y = torch.randint(0, 5 * world, (6,), generator=g)

    def loss(h, w):
        logp, ent = fusedloss.linear_log_probs(h, w, y, temperature=0.8, return_entropy=True,
                                               process_group=dist.group.WORLD)
        return (logp * torch.linspace(-1, 1, 6)).sum() + ent.sum()

    got = torch.compile(loss, backend="aot_eager")(h, w)
    grads = torch.autograd.grad(got, (h, w))
    want = loss(h, w)
    want_grads = torch.autograd.grad(want, (h, w))
    torch.testing.assert_close(got, want)
    for x, r in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(x, r)
    return True


def test_sharded_log_probs_under_compile(workers):
    assert all_ok(workers(2).run(_log_probs_compiled)) == [True, True]


def _log_probs_vocab_start(rank, world):
    """Shards given out of rank order (rank 0 holds the last rows) through ``vocab_start``."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(7, 4, generator=g)
    w = torch.randn(10, 4, generator=g)
    y = torch.randint(0, 10, (7,), generator=g)
    lo, hi = (6, 10) if rank == 0 else (0, 6)
    logp = fusedloss.linear_log_probs(h, w[lo:hi], y, process_group=dist.group.WORLD,
                                      vocab_start=lo)
    return logp, fusedloss.linear_log_probs(h, w, y)


def test_sharded_log_probs_explicit_vocab_start(workers):
    for got, want in all_ok(workers(2).run(_log_probs_vocab_start)):
        torch.testing.assert_close(got, want)
