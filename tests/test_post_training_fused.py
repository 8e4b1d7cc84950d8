"""GRPO's, DPO's, CPO's, ORPO's and KTO's losses fused into the LM head (``ops.post_training``, the
Triton backend) against the same losses on ``linear_log_probs`` (the torch backend in fp32, which
``test_post_training.py`` holds to TRL's own code): values and gradients for every loss type
and option, in one chunk and in chunks of whole sequences / pairs, ignored and bad tokens, and
under ``torch.compile(fullgraph=True)``; bf16 within the bar on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, ON_GPU, assert_close_to_ref, requires_triton

from fusedloss import post_training

pytestmark = requires_triton

B, T, D, V = 4, 6, 16, 50
GRPO_CASES = {
    "dapo": dict(loss_type="dapo", beta=0.0),
    "dapo-kl-temperature-softcap": dict(loss_type="dapo", beta=0.04, temperature=0.7,
                                        softcap=2.0),
    "grpo-kl-no-correction": dict(loss_type="grpo", beta=0.1, kl_bias_correction=False),
    "bnpo-asymmetric-delta": dict(loss_type="bnpo", epsilon_high=0.28, delta=1.5),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.04, max_completion_length=10),
    "grpo-sequence": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "grpo-on-policy": dict(loss_type="grpo", beta=0.04, old=False),
    "dapo-num-items-token-advantages": dict(loss_type="dapo", num_items_in_batch=40.0,
                                            per_token=True),
}


def _grpo_inputs(seed=0, per_token=False, bias=False):
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g) / 3,
              torch.randn(V, generator=g) if bias else None]
    leaves = [None if t is None else t.to(DEVICE).requires_grad_() for t in leaves]
    ids = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    mask[:, 0] = 1
    adv = torch.randn((B, T) if per_token else (B,), generator=g)
    old, ref = (torch.randn(B, T, generator=g) * 0.3 - 3.5 for _ in range(2))
    return leaves, ids, mask.to(DEVICE), adv.to(DEVICE), old.to(DEVICE), ref.to(DEVICE)


def _grads(loss, leaves):
    return torch.autograd.grad(loss, [t for t in leaves if t is not None])


def _assert_backends_agree(loss_of, leaves):
    """The Triton backend's loss and gradients (input, weight, bias) equal the torch
    backend's: ``loss_of(backend)`` computes the loss."""
    results = {}
    for backend in ("torch", "triton"):
        loss = loss_of(backend)
        results[backend] = (loss, _grads(loss, leaves))
    (want, want_grads), (got, got_grads) = results["torch"], results["triton"]
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    for name, x, r in zip(("d input", "d weight", "d bias"), got_grads, want_grads, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-4, atol=1e-5 * float(r.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")



@pytest.mark.parametrize("rows", [None, 5, 2 * T])
@pytest.mark.parametrize("case", GRPO_CASES, ids=list(GRPO_CASES))
def test_fused_grpo_equals_the_unfused(case, rows, tune):
    """In one chunk, or in chunks of 5 rows or two sequences (``Tuning.lm_head_chunk_bytes``):
    token-level importance sampling in chunks that cut sequences, sequence level then on the
    log-probs (a sequence must fit a chunk)."""
    kw = dict(GRPO_CASES[case])
    (h, w, b), ids, mask, adv, old, ref = _grpo_inputs(per_token=kw.pop("per_token", False),
                                                       bias=True)
    if not kw.pop("old", True):
        old = None
    if rows is not None:
        tune(lm_head_chunk_bytes=rows * V * 4)
    _assert_backends_agree(lambda backend: post_training.grpo_loss(
        h, w, ids, mask, adv, old_log_probs=old, ref_log_probs=ref, linear_bias=b,
        backend=backend, **kw), (h, w, b))


def test_fused_grpo_is_the_training_path_and_nan_in_gives_nan_out():
    """With gradients on the Triton backend the fused op runs (one call of it); without, the
    loss runs on the log-probs. A target outside the vocabulary makes the loss NaN."""
    from fusedloss.ops import post_training as ops

    (h, w, _), ids, mask, adv, old, ref = _grpo_inputs()
    calls = []
    original = ops.grpo_loss_fused
    ops.grpo_loss_fused = lambda *args: calls.append(1) or original(*args)
    try:
        post_training.grpo_loss(h, w, ids, mask, adv, old_log_probs=old, backend="triton")
        with torch.no_grad():
            no_grad = post_training.grpo_loss(h, w, ids, mask, adv, old_log_probs=old,
                                              backend="triton")
    finally:
        ops.grpo_loss_fused = original
    assert calls == [1] and no_grad.isfinite()
    bad = ids.clone()
    bad[1, 2] = V + 5
    loss = post_training.grpo_loss(h, w, bad, mask, adv, old_log_probs=old, backend="triton")
    assert loss.isnan()


def test_fused_path_needs_a_group_to_fit_a_chunk(tune):
    """A chunk holds whole sequences (GRPO at the sequence level) or pairs (DPO): where one
    holds more logits than ``Tuning.lm_head_chunk_bytes`` the loss runs on the log-probs (its
    memory bounded), with the same value; token-level GRPO stays fused with any chunk."""
    from fusedloss.ops import post_training as ops

    tune(lm_head_chunk_bytes=T * V * 4)  # one sequence of fp32 logits: not a pair
    (h, w, _), ids, mask, adv, old, _ = _grpo_inputs()
    (hd, wd, _), target, ref_h, ref_w = _dpo_inputs()
    calls = []
    originals = ops.grpo_loss_fused, ops.dpo_loss_fused
    ops.grpo_loss_fused = lambda *a: calls.append("grpo") or originals[0](*a)
    ops.dpo_loss_fused = lambda *a: calls.append("dpo") or originals[1](*a)
    try:
        for level in ("token", "sequence"):
            post_training.grpo_loss(h, w, ids, mask, adv, old_log_probs=old, loss_type="grpo",
                                    importance_sampling_level=level, backend="triton")
        post_training.dpo_loss(hd, wd, target, ref_input=ref_h, ref_weight=ref_w,
                               backend="triton")
        assert calls == ["grpo", "grpo"]  # T rows fit: the sequence level too
        tune(lm_head_chunk_bytes=T * V * 4 - 1)
        calls.clear()
        for level in ("token", "sequence"):
            post_training.grpo_loss(h, w, ids, mask, adv, old_log_probs=old, loss_type="grpo",
                                    importance_sampling_level=level, backend="triton")
        assert calls == ["grpo"]
    finally:
        ops.grpo_loss_fused, ops.dpo_loss_fused = originals


def _dpo_inputs(seed=1, bias=False):
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(2 * B, T, D, generator=g), torch.randn(V, D, generator=g) / 3,
              torch.randn(V, generator=g) if bias else None]
    leaves = [None if t is None else t.to(DEVICE).requires_grad_() for t in leaves]
    target = torch.randint(0, V, (2 * B, T), generator=g)
    target[:, :2] = -100  # the prompt
    target[torch.rand(2 * B, T, generator=g) < 0.2] = -100  # padding
    ref_h = torch.randn(2 * B, T, D, generator=g).to(DEVICE)
    ref_w = (torch.randn(V, D, generator=g) / 3).to(DEVICE)
    return leaves, target.to(DEVICE), ref_h, ref_w


@pytest.mark.parametrize("rows", [None, 2 * T])
@pytest.mark.parametrize("loss_type, extra", [
    ("sigmoid", dict(shift=True)), ("hinge", dict(softcap=3.0)),
    # IPO's (x − 1/(2β))² cancels: one reference for both backends
    ("ipo", dict(beta=0.5, reference="log_probs")),
    ("robust", dict(label_smoothing=0.1, reference="log_probs"))])
def test_fused_dpo_equals_the_unfused(loss_type, extra, rows, tune):
    """One chunk, or chunks of one pair (a chosen and its rejected sequence, 2T rows)."""
    (h, w, b), target, ref_h, ref_w = _dpo_inputs(bias=True)
    extra = dict(extra)
    if extra.pop("reference", None) == "log_probs":
        reference = dict(ref_log_probs=torch.randn(2 * B, device=DEVICE) - 10)
    else:
        reference = dict(ref_input=ref_h, ref_weight=ref_w)
    if rows is not None:
        tune(lm_head_chunk_bytes=rows * V * 4)
    _assert_backends_agree(lambda backend: post_training.dpo_loss(
        h, w, target, linear_bias=b, loss_type=loss_type, backend=backend, **reference,
        **extra), (h, w, b))


@pytest.mark.parametrize("rows", [None, 2 * T])
@pytest.mark.parametrize("loss_type, extra", [  # the last three in make test-slow
    ("sigmoid", dict(label_smoothing=0.1, cpo_alpha=1.0)),
    ("simpo", dict(softcap=3.0, cpo_alpha=0.5)),
    pytest.param("hinge", dict(shift=True), marks=pytest.mark.slow),
    pytest.param("ipo", dict(beta=0.5, cpo_alpha=0.0), marks=pytest.mark.slow),
    pytest.param("simpo", dict(beta=2.0, simpo_gamma=0.5), marks=pytest.mark.slow)])
def test_fused_cpo_equals_the_unfused(loss_type, extra, rows, tune):
    """CPO (SimPO) with its NLL term on the chosen tokens, one chunk or one pair per chunk."""
    (h, w, b), target, _, _ = _dpo_inputs(bias=True)
    if rows is not None:
        tune(lm_head_chunk_bytes=rows * V * 4)
    _assert_backends_agree(lambda backend: post_training.cpo_loss(
        h, w, target, linear_bias=b, loss_type=loss_type, backend=backend, **extra), (h, w, b))


@pytest.mark.parametrize("rows", [None, 2 * T])
@pytest.mark.parametrize("extra", [dict(beta=0.2), dict(shift=True, softcap=3.0)])
def test_fused_orpo_equals_the_unfused(extra, rows, tune):
    """ORPO's odds-ratio term and the chosen tokens' NLL in one pass, chunks of whole pairs."""
    (h, w, b), target, _, _ = _dpo_inputs(bias=True)
    if rows is not None:
        tune(lm_head_chunk_bytes=rows * V * 4)
    _assert_backends_agree(lambda backend: post_training.orpo_loss(
        h, w, target, linear_bias=b, backend=backend, **extra), (h, w, b))


@pytest.mark.parametrize("rows", [None, T])
@pytest.mark.parametrize("loss_type, extra", [  # the second in make test-slow
    ("kto", dict(kl=0.3, desirable_weight=1.5)),
    pytest.param("kto", dict(shift=True, reference="head"), marks=pytest.mark.slow),
    ("apo_zero_unpaired", dict(undesirable_weight=0.7, softcap=3.0))])
def test_fused_kto_equals_the_unfused(loss_type, extra, rows, tune):
    """KTO, one completion per group: one chunk or one sequence per chunk."""
    (h, w, b), target, ref_h, ref_w = _dpo_inputs(bias=True)
    extra = dict(extra)
    desirable = torch.tensor([True, False] * B, device=DEVICE)
    if extra.pop("reference", None) == "head":
        reference = dict(ref_input=ref_h, ref_weight=ref_w)
    else:
        reference = dict(ref_log_probs=torch.randn(2 * B, device=DEVICE) - 10)
    if rows is not None:
        tune(lm_head_chunk_bytes=rows * V * 4)
    _assert_backends_agree(lambda backend: post_training.kto_loss(
        h, w, target, desirable, linear_bias=b, loss_type=loss_type, backend=backend,
        **reference, **extra), (h, w, b))


@pytest.mark.parametrize("name", ["grpo", pytest.param("dpo", marks=pytest.mark.slow), "cpo", "kto",
                                  "orpo"])
def test_fused_losses_compile_with_fullgraph(name):
    torch._dynamo.reset()
    if name == "grpo":
        (h, w, _), ids, mask, adv, old, ref = _grpo_inputs()

        def fn(h, w):
            return post_training.grpo_loss(h, w, ids, mask, adv, old_log_probs=old,
                                           ref_log_probs=ref, beta=0.04, backend="triton")
    elif name == "dpo":
        (h, w, _), target, ref_h, ref_w = _dpo_inputs()

        def fn(h, w):
            return post_training.dpo_loss(h, w, target, ref_input=ref_h, ref_weight=ref_w,
                                          shift=True, backend="triton")
    elif name in ("cpo", "orpo"):
        (h, w, _), target, _, _ = _dpo_inputs()

        def fn(h, w):
            if name == "orpo":
                return post_training.orpo_loss(h, w, target, backend="triton")
            return post_training.cpo_loss(h, w, target, loss_type="simpo", backend="triton")
    else:
        (h, w, _), target, _, _ = _dpo_inputs()
        desirable = torch.tensor([True, False] * B, device=DEVICE)
        ref = torch.randn(2 * B, device=DEVICE) - 10

        def fn(h, w):
            return post_training.kto_loss(h, w, target, desirable, ref_log_probs=ref,
                                          kl=0.2, backend="triton")
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(h, w), fn(h, w)
    torch.testing.assert_close(got, want)
    for x, r in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w)),
                    strict=True):
        torch.testing.assert_close(x, r)


def _materialized(h, w, ids, temperature=1.0):
    """PyTorch's log-probs in the operands' dtype: the logits of ``F.linear``, then an fp32
    log-softmax (what a trainer computes)."""
    logits = torch.nn.functional.linear(h, w).float() / temperature
    return logits.log_softmax(-1).gather(-1, ids.clamp(min=0)[..., None])[..., 0]


@pytest.mark.skipif(not ON_GPU, reason="bf16 of the Triton path is judged on a GPU")
def test_fused_bf16_within_the_bar():
    """bf16: the fused GRPO's and DPO's d input within 1.5× the error of PyTorch's bf16
    computation of the same loss (bf16 logits, fp32 softmax) against the fp32 one."""
    from fusedloss.families import post_training as family

    (h, w, _), ids, mask, adv, old, ref = _grpo_inputs()
    (hd, wd, _), target, ref_h, ref_w = _dpo_inputs()
    ref_sums = torch.randn(2 * B, device=DEVICE) - 10
    counted = (target != -100).float()
    lengths = counted.sum(-1).clamp(min=1)
    grpo_options = family.GRPOOptions(beta=0.04)

    def grpo_pytorch(h, w):
        lp = _materialized(h, w, ids, 0.7)
        weight = family.grpo_token_weights(mask.float(), "dapo", None, None)
        return (family.grpo_token_terms(lp, old, ref, adv[:, None], mask.float(),
                                        grpo_options) * weight).sum()

    def dpo_pytorch(h, w):
        sums = (_materialized(h, w, target) * counted).sum(-1) - ref_sums
        return family.dpo_pair_losses(*sums.chunk(2), *lengths.chunk(2), 0.1, "sigmoid",
                                      0.0).mean()

    cases = {
        "grpo": (lambda h, w: post_training.grpo_loss(
            h, w, ids, mask, adv, old_log_probs=old, ref_log_probs=ref, beta=0.04,
            temperature=0.7, backend="triton"), grpo_pytorch, h, w),
        "dpo": (lambda h, w: post_training.dpo_loss(
            h, w, target, ref_log_probs=ref_sums, backend="triton"), dpo_pytorch, hd, wd)}
    for name, (fused, pytorch, h32, w32) in cases.items():
        h16, w16 = (t.detach().bfloat16().requires_grad_() for t in (h32, w32))
        ref_grad = torch.autograd.grad(pytorch(h32, w32), h32)[0]
        ours = torch.autograd.grad(fused(h16, w16), h16)[0]
        theirs = torch.autograd.grad(pytorch(h16, w16), h16)[0]
        assert_close_to_ref(ours.float(), theirs.float(), ref_grad, name=f"{name} d input")
