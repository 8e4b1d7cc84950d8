"""``fusedloss.linear_kl_div`` and ``linear_jsd`` against float64 and TRL's GKD loss.

The divergences are computed a block of rows at a time; the tests shrink the blocks
(``Tuning.torch_chunk_elements`` on the torch backend, ``Tuning.lm_head_chunk_bytes`` on the
Triton one) so that several blocks run, and check values and gradients (student and teacher)
against ``fusedloss.reference.linear_divergence_ref``, in low precision against PyTorch's own
error in that dtype. The Triton backend has two paths: the per-token op (its backward from an
upstream gradient per row) and the reduced loss's training path (the student's gradients formed
in the forward); both are tested.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, ON_GPU, assert_close_to_ref, requires_triton
from hypothesis import given
from hypothesis import strategies as st

import fusedloss
from fusedloss.core import config
from fusedloss.reference import linear_divergence_ref

V = 40


def _inputs(seed, lead=(3, 5), ds=12, dt=20, dtype=torch.float64, bias=False):
    g = torch.Generator().manual_seed(seed)
    a_s = torch.randn(*lead, ds, generator=g)
    w_s = torch.randn(V, ds, generator=g) / math.sqrt(ds) * 2
    a_t = torch.randn(*lead, dt, generator=g)
    w_t = torch.randn(V, dt, generator=g) / math.sqrt(dt) * 3
    b_s, b_t = (torch.randn(V, generator=g) if bias else None for _ in range(2))
    labels = torch.randint(0, V, lead, generator=g)
    labels[torch.rand(lead, generator=g) < 0.3] = -100
    return [t if t is None else t.to(dtype).requires_grad_() for t in
            (a_s, w_s, a_t, w_t, b_s, b_t)] + [labels]


def _call(kind, beta, inputs, temperature, reduction="none", labels=True, backend="auto"):
    a_s, w_s, a_t, w_t, b_s, b_t, y = inputs
    common = dict(student_bias=b_s, teacher_bias=b_t, temperature=temperature,
                  reduction=reduction, labels=y if labels else None, backend=backend)
    if kind == "jsd":
        return fusedloss.linear_jsd(a_s, w_s, a_t, w_t, beta=beta, **common)
    return fusedloss.linear_kl_div(a_s, w_s, a_t, w_t, direction=kind, **common)


def _torch_divergence(kind, beta, a_s, w_s, a_t, w_t, b_s=None, b_t=None, temperature=1.0):
    """Each token's divergence in plain PyTorch, the logits in the inputs' dtype and the rest
    in fp32: PyTorch's own error in that dtype, the yardstick of ``assert_close_to_ref``."""
    s = F.log_softmax(F.linear(a_s, w_s, b_s).float() / temperature, -1)
    t = F.log_softmax(F.linear(a_t, w_t, b_t).float() / temperature, -1)

    def kl(p, q):  # KL(p ‖ q) from log-probabilities
        return F.kl_div(q, p, reduction="none", log_target=True).sum(-1)

    if kind == "jsd" and beta in (0.0, 1.0):
        kind = "forward" if beta == 0.0 else "reverse"
    if kind == "forward":
        return kl(t, s)
    if kind == "reverse":
        return kl(s, t)
    m = torch.log(beta * t.exp() + (1 - beta) * s.exp())
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


@given(kind=st.sampled_from(["forward", "reverse", "jsd"]),
       beta=st.sampled_from([0.0, 0.3, 0.5, 1.0]), temperature=st.sampled_from([1.0, 0.7, 2.0]),
       bias=st.booleans(), seed=st.integers(0, 2**16),
       chunk=st.sampled_from([V, 3 * V, 1 << 24]))
def test_matches_float64_reference(kind, beta, temperature, bias, seed, chunk):
    inputs = _inputs(seed, bias=bias)
    a_s, w_s, a_t, w_t, b_s, b_t, y = inputs
    with config.tuned(torch_chunk_elements=chunk):  # 1 row, 3 rows, or every row per block
        got = _call(kind, beta, inputs, temperature)
    want = linear_divergence_ref(a_s, w_s, a_t, w_t, kind=kind, beta=beta, student_bias=b_s,
                                 teacher_bias=b_t, temperature=temperature)
    want = torch.where(y != -100, want, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    leaves = [t for t in (a_s, w_s, a_t, w_t, b_s, b_t) if t is not None]
    upstream = torch.linspace(0.5, 1.5, got.numel(), dtype=got.dtype).view(got.shape)
    with config.tuned(torch_chunk_elements=chunk):
        got_grads = torch.autograd.grad((got * upstream).sum(), leaves)
    for x, r in zip(got_grads, torch.autograd.grad((want * upstream).sum(), leaves),
                    strict=True):
        torch.testing.assert_close(x, r, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=pytest.mark.skipif(
        not ON_GPU, reason="bf16 of the Triton path is judged on a GPU (the interpreter "
        "truncates)"))])
@pytest.mark.parametrize("kind", ["forward", "reverse", "jsd"])
def test_bf16_within_the_bar(kind, backend, tune):
    """bf16 operands: our error against float64 at most 1.5× PyTorch's own bf16 one."""
    tune(torch_chunk_elements=4 * V, lm_head_chunk_bytes=2 * 4 * V * 2)
    inputs = [t if t is None or t.dtype == torch.int64 else t.detach().to(DEVICE).requires_grad_()
              for t in _inputs(3, lead=(8, 9), dtype=torch.bfloat16)]
    inputs[6] = inputs[6].to(DEVICE)
    a_s, w_s, a_t, w_t, _, _, y = inputs
    ours = _call(kind, 0.5, inputs, 1.0, backend=backend)
    ref = torch.where(y != -100, linear_divergence_ref(a_s, w_s, a_t, w_t, kind=kind), 0.0)

    theirs = torch.where(y != -100, _torch_divergence(kind, 0.5, a_s, w_s, a_t, w_t), 0.0)
    assert_close_to_ref(ours, theirs, ref, name=f"{kind} values")
    grads = [torch.autograd.grad(x.sum(), (a_s, w_s), retain_graph=True)
             for x in (ours, theirs, ref)]
    for i, name in enumerate(("d student_input", "d student_weight")):
        assert_close_to_ref(grads[0][i], grads[1][i], grads[2][i], name=name)
    # the reduced loss (on the Triton backend its training path)
    count = (y != -100).sum()
    mean = _call(kind, 0.5, [*inputs[:2], a_t.detach(), w_t.detach(), *inputs[4:]], 1.0,
                 reduction="mean", backend=backend)
    assert_close_to_ref(mean, theirs.sum() / count, ref.sum() / count, name=f"{kind} mean")
    grads = [torch.autograd.grad(x, (a_s, w_s))
             for x in (mean, theirs.sum() / count, ref.sum() / count)]
    for i, name in enumerate(("d student_input (mean)", "d student_weight (mean)")):
        assert_close_to_ref(grads[0][i], grads[1][i], grads[2][i], name=name)


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
def test_jsd_equals_trls_gkd_loss(beta):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")  # TRL's trainers import it
    from trl.experimental.gkd import GKDTrainer

    inputs = _inputs(5, bias=True)
    a_s, w_s, a_t, w_t, b_s, b_t, y = inputs
    want = GKDTrainer.generalized_jsd_loss(F.linear(a_s, w_s, b_s), F.linear(a_t, w_t, b_t),
                                           labels=y, beta=beta, temperature=0.8)
    got = fusedloss.linear_jsd(a_s, w_s, a_t, w_t, beta=beta, student_bias=b_s,
                               teacher_bias=b_t, temperature=0.8, labels=y)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    for x, r in zip(torch.autograd.grad(got, (a_s, w_s), retain_graph=True),
                    torch.autograd.grad(want, (a_s, w_s)), strict=True):
        torch.testing.assert_close(x, r, rtol=1e-8, atol=1e-12)


def test_reductions_and_the_teacher_gradient():
    inputs = _inputs(7)
    a_s, w_s, a_t, w_t, _, _, y = inputs
    per_token = fusedloss.linear_kl_div(a_s, w_s, a_t, w_t, labels=y, reduction="none")
    counted = y != -100
    torch.testing.assert_close(
        fusedloss.linear_kl_div(a_s, w_s, a_t, w_t, labels=y), per_token.sum() / counted.sum())
    torch.testing.assert_close(
        fusedloss.linear_kl_div(a_s, w_s, a_t, w_t, labels=y, reduction="sum"), per_token.sum())
    other = torch.where(y == -100, 7, y)  # the same positions marked by another value
    torch.testing.assert_close(
        fusedloss.linear_kl_div(a_s, w_s, a_t, w_t, labels=torch.where(y == -100, -1, other),
                                ignore_index=-1),
        per_token.sum() / counted.sum())
    torch.testing.assert_close(fusedloss.linear_kl_div(a_s, w_s, a_t, w_t),
                               fusedloss.linear_kl_div(a_s, w_s, a_t, w_t,
                                                       reduction="none").mean())
    # the teacher detached: no gradient there; attached: the reference's
    loss = fusedloss.linear_kl_div(a_s, w_s, a_t.detach(), w_t.detach())
    loss.backward()
    assert a_t.grad is None and w_s.grad is not None
    got = torch.autograd.grad(fusedloss.linear_kl_div(a_s, w_s, a_t, w_t, direction="reverse"),
                              (a_t, w_t))
    want = torch.autograd.grad(linear_divergence_ref(a_s, w_s, a_t, w_t, kind="reverse").mean(),
                               (a_t, w_t))
    for x, r in zip(got, want, strict=True):
        torch.testing.assert_close(x, r)


@pytest.mark.parametrize("call, error, match", [
    (lambda i: fusedloss.linear_kl_div(*i[:4], direction="sideways"), ValueError, "direction"),
    (lambda i: fusedloss.linear_jsd(*i[:4], beta=1.5), ValueError, "beta"),
    (lambda i: fusedloss.linear_kl_div(*i[:4], temperature=0.0), ValueError, "temperature"),
    (lambda i: fusedloss.linear_kl_div(*i[:4], reduction="batchmean"), ValueError, "reduction"),
    (lambda i: fusedloss.linear_kl_div(i[0], i[1], i[2][:2], i[3]), ValueError, "leading"),
    (lambda i: fusedloss.linear_kl_div(i[0], i[1], i[2], i[3][:7]), ValueError, "vocabulary"),
    (lambda i: fusedloss.linear_kl_div(*i[:4], labels=i[6][:1]), ValueError, "labels"),
    (lambda i: fusedloss.linear_kl_div(i[0], i[1].float(), i[2], i[3]), TypeError,
     "student_weight"),
])
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call(_inputs(0))


@pytest.mark.parametrize("function", ["jsd", "kl", "top-k"])
def test_compiles_with_fullgraph(function):
    torch._dynamo.reset()
    inputs = _inputs(9, dtype=torch.float32, bias=True)
    a_s, w_s, a_t, w_t, b_s, b_t, y = inputs
    top_lp, top_ids = torch.log_softmax((a_t @ w_t.T).detach(), -1).topk(5, dim=-1)

    def loss(a, w):
        if function == "top-k":
            return fusedloss.linear_top_k_kl(a, w, top_lp, top_ids, student_bias=b_s,
                                             temperature=0.9, labels=y)
        if function == "kl":
            return fusedloss.linear_kl_div(a, w, a_t, w_t, direction="reverse",
                                           student_bias=b_s, teacher_bias=b_t, labels=y)
        return fusedloss.linear_jsd(a, w, a_t, w_t, beta=0.3, student_bias=b_s,
                                    teacher_bias=b_t, temperature=0.9, labels=y)

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got, want = compiled(a_s, w_s), loss(a_s, w_s)
    torch.testing.assert_close(got, want)
    for x, r in zip(torch.autograd.grad(got, (a_s, w_s)), torch.autograd.grad(want, (a_s, w_s)),
                    strict=True):
        torch.testing.assert_close(x, r)


# ------------------------------------------------------------------------------------------
# the Triton backend: the per-token op and the reduced loss's training path


def _on_device(inputs, dtype=torch.float32):
    return [None if t is None else t.to(DEVICE) if t.dtype == torch.int64 else
            t.detach().to(DEVICE, dtype).requires_grad_() for t in inputs]


@pytest.mark.slow  # ~20 s on the interpreter: ``make test-slow``
@requires_triton
@given(kind=st.sampled_from(["forward", "reverse", "jsd"]),
       beta=st.sampled_from([0.0, 0.3, 0.5, 1.0]), temperature=st.sampled_from([1.0, 0.7, 2.0]),
       bias=st.booleans(), seed=st.integers(0, 2**16),
       reduction=st.sampled_from(["none", "mean", "sum"]), labels=st.booleans(),
       chunk_rows=st.sampled_from([1, 4, 64]))
def test_triton_matches_float64_reference(kind, beta, temperature, bias, seed, reduction, labels,
                                          chunk_rows):
    """fp32 on the Triton backend, in chunks of 1, 4 or every row: values and the student's
    gradients (a reduced loss through the training path) at fp32's precision."""
    inputs = _inputs(seed, bias=bias)
    ref_inputs = inputs
    dev = _on_device(inputs)
    a_s, w_s, a_t, w_t, b_s, b_t, y = ref_inputs
    # both models' logits in fp32: 8 bytes per column of a row
    with config.tuned(lm_head_chunk_bytes=chunk_rows * 8 * V):
        got = _call(kind, beta, [*dev[:2], dev[2].detach(), dev[3].detach(), *dev[4:]],
                    temperature, reduction=reduction, labels=labels, backend="triton")
        want = linear_divergence_ref(a_s, w_s, a_t, w_t, kind=kind, beta=beta,
                                     student_bias=b_s, teacher_bias=b_t,
                                     temperature=temperature)
        if labels:
            want = torch.where(y != -100, want, 0.0)
        count = (y != -100).sum() if labels else y.numel()
        want = {"none": want, "sum": want.sum(), "mean": want.sum() / count}[reduction]
        torch.testing.assert_close(got.cpu().double(), want, rtol=2e-5, atol=2e-6)
        students = [t for t in (dev[0], dev[1], dev[4]) if t is not None]
        upstream = torch.linspace(0.5, 1.5, got.numel(), dtype=got.dtype,
                                  device=got.device).view(got.shape)
        got_grads = torch.autograd.grad((got * upstream).sum(), students)
    want_grads = torch.autograd.grad((want * upstream.cpu().double()).sum(),
                                     [t for t in (a_s, w_s, b_s) if t is not None])
    # PyTorch's fp32 computation of the same quantity: the gradients' yardstick (a gradient
    # entry summed over cancelling terms is off by more than a fixed tolerance on a GPU)
    theirs = _torch_divergence(kind, beta, *dev[:6], temperature=temperature)
    if labels:
        theirs = torch.where(dev[6] != -100, theirs, 0.0)
    theirs = {"none": theirs, "sum": theirs.sum(), "mean": theirs.sum() / count}[
        reduction]
    their_grads = torch.autograd.grad((theirs * upstream).sum(), students)
    for x, t, r, name in zip(got_grads, their_grads, want_grads, ("input", "weight", "bias"),
                             strict=False):
        assert_close_to_ref(x.cpu(), t.cpu(), r, name=f"d student_{name}")


@requires_triton
def test_triton_reduced_loss_takes_the_training_path_and_skips_ignored_rows():
    """A reduced loss with a student that needs gradients runs the training path (one op, no
    per-token backward), with each row's share: a NaN in an ignored row does not reach the
    loss, one in a counted row does; every token ignored gives 0 and zero gradients."""
    from fusedloss.ops import distillation as ops

    inputs = _on_device(_inputs(5, bias=True))
    a_s, w_s, a_t, w_t, b_s, b_t, y = inputs
    calls = []
    original = ops.linear_divergence_reduced
    try:
        ops.linear_divergence_reduced = lambda *args: calls.append(args) or original(*args)
        mean = fusedloss.linear_jsd(a_s, w_s, a_t.detach(), w_t.detach(), beta=0.3,
                                    student_bias=b_s, labels=y, backend="triton")
    finally:
        ops.linear_divergence_reduced = original
    assert len(calls) == 1
    per_token = fusedloss.linear_jsd(a_s, w_s, a_t.detach(), w_t.detach(), beta=0.3,
                                      student_bias=b_s, labels=y, reduction="none",
                                      backend="triton")
    counted = y != -100
    torch.testing.assert_close(mean, per_token.sum() / counted.sum())
    for x, r in zip(torch.autograd.grad(mean, (a_s, w_s, b_s)),
                    torch.autograd.grad(per_token.sum() / counted.sum(), (a_s, w_s, b_s)),
                    strict=True):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-7)
    # NaN in the hidden state of an ignored token, then of a counted one
    first_ignored = int(torch.nonzero(~counted.reshape(-1))[0])
    first_counted = int(torch.nonzero(counted.reshape(-1))[0])
    for row, nan in ((first_ignored, False), (first_counted, True)):
        poisoned = a_s.detach().clone().reshape(-1, a_s.shape[-1])
        poisoned[row] = float("nan")
        loss = fusedloss.linear_kl_div(poisoned.view(a_s.shape).requires_grad_(), w_s,
                                       a_t.detach(), w_t.detach(), labels=y, backend="triton")
        assert bool(loss.isnan()) == nan
    none = torch.full_like(y, -100)
    loss = fusedloss.linear_kl_div(a_s, w_s, a_t.detach(), w_t.detach(), labels=none,
                                   backend="triton")
    assert float(loss) == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in torch.autograd.grad(loss, (a_s, w_s)))


@requires_triton
def test_triton_teacher_gradients_take_the_per_token_path():
    """A teacher that needs gradients gets the reference's (the reduced path has none)."""
    a_s, w_s, a_t, w_t, _, _, y = _on_device(_inputs(8))
    got = torch.autograd.grad(fusedloss.linear_kl_div(a_s, w_s, a_t, w_t, direction="reverse",
                                                      labels=y, backend="triton"), (a_t, w_t))
    ref = [t.detach().cpu().double().requires_grad_() for t in (a_s, w_s, a_t, w_t)]
    want_tok = linear_divergence_ref(*ref, kind="reverse")
    counted = (y != -100).cpu()
    want = torch.autograd.grad(torch.where(counted, want_tok, 0.0).sum() / counted.sum(),
                               ref[2:])
    for x, r in zip(got, want, strict=True):
        torch.testing.assert_close(x.cpu().double(), r, rtol=1e-4, atol=1e-6)


@requires_triton
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_compiles_with_fullgraph(reduction):
    torch._dynamo.reset()
    a_s, w_s, a_t, w_t, b_s, b_t, y = _on_device(_inputs(9, bias=True))

    def loss(a, w):
        out = fusedloss.linear_jsd(a, w, a_t.detach(), w_t.detach(), beta=0.3, student_bias=b_s,
                                   teacher_bias=b_t.detach(), temperature=0.9, labels=y,
                                   reduction=reduction, backend="triton")
        return out.sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got, want = compiled(a_s, w_s), loss(a_s, w_s)
    torch.testing.assert_close(got, want)
    for x, r in zip(torch.autograd.grad(got, (a_s, w_s)), torch.autograd.grad(want, (a_s, w_s)),
                    strict=True):
        torch.testing.assert_close(x, r)


# ------------------------------------------------------------------------------------------
# offline distillation from a teacher's top-k


def test_top_k_kl_matches_float64(tune):
    tune(torch_chunk_elements=2 * V)  # blocks of 2 rows
    a_s, w_s, a_t, w_t, b_s, _, y = _inputs(11, bias=True)
    teacher = torch.log_softmax((a_t @ w_t.T).detach() / 0.8, -1)
    top_lp, top_ids = teacher.topk(6, dim=-1)
    got = fusedloss.linear_top_k_kl(a_s, w_s, top_lp, top_ids, student_bias=b_s,
                                    temperature=0.8, labels=y, reduction="none")
    student = torch.log_softmax((a_s @ w_s.T + b_s) / 0.8, -1)
    want = (top_lp.exp() * (top_lp - student.gather(-1, top_ids))).sum(-1)
    want = torch.where(y != -100, want, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    for x, r in zip(torch.autograd.grad(got.sum(), (a_s, w_s, b_s)),
                    torch.autograd.grad(want.sum(), (a_s, w_s, b_s)), strict=True):
        torch.testing.assert_close(x, r, rtol=1e-8, atol=1e-12)
    # every token of the vocabulary: the forward KL
    full_lp, full_ids = teacher.topk(V, dim=-1)
    torch.testing.assert_close(
        fusedloss.linear_top_k_kl(a_s, w_s, full_lp, full_ids, student_bias=b_s,
                                  temperature=0.8),
        fusedloss.linear_kl_div(a_s, w_s, a_t.detach(), w_t.detach(), student_bias=b_s,
                                temperature=0.8))
    with pytest.raises(ValueError, match="teacher_ids"):
        fusedloss.linear_top_k_kl(a_s, w_s, top_lp, top_ids[..., :3])
    bad = top_ids.clone()
    bad[0, 1, 2] = V
    out = fusedloss.linear_top_k_kl(a_s, w_s, top_lp, bad, reduction="none")
    assert out[0, 1].isnan() and torch.isfinite(out[1]).all()
