"""``fusedloss.linear_log_probs``: token log-probabilities and entropies through an LM head.

Property tests against the float64 reference (``fusedloss.reference.linear_log_probs_ref``)
on both backends, every option drawn; the accuracy bar in low precision is the library's (our
error ≤ 1.5× PyTorch's own in the same dtype, ``helpers.assert_close_to_ref``); then the
options one by one, bad input, NaN, compile and the engine's row blocks with the entropy term.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DEVICE,
    ON_GPU,
    assert_close_to_ref,
    default_floor,
    note_case,
    rel_err,
    requires_triton,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import fusedloss
from fusedloss.reference import linear_log_probs_ref

TRITON_EXAMPLES = 8


@dataclass(frozen=True)
class Case:
    lead: tuple[int, ...]
    v: int
    d: int
    dtype: torch.dtype
    temperature: float = 1.0
    softcap: float | None = None
    bias: bool = False
    shift: bool = False
    ignore_fraction: float = 0.0
    peaked: bool = False  # trained-like logits: most of the mass on a few tokens
    seed: int = 0


def make(case: Case, device: str = DEVICE):
    """(input, weight, target, bias or None), leaves that require gradients."""
    g = torch.Generator().manual_seed(case.seed)
    h = torch.randn(*case.lead, case.d, generator=g)
    w = torch.randn(case.v, case.d, generator=g) / math.sqrt(case.d)
    target = torch.randint(0, case.v, case.lead, generator=g)
    if case.peaked:  # each token's hidden state points at its target's row
        h = h + 6.0 * math.sqrt(case.d) * w[target]
    target = torch.where(torch.rand(case.lead, generator=g) < case.ignore_fraction, -100, target)
    bias = 0.5 * torch.randn(case.v, generator=g) if case.bias else None
    leaves = [t.to(device, case.dtype).requires_grad_() if t is not None else None
              for t in (h, w, bias)]
    return leaves[0], leaves[1], target.to(device), leaves[2]


def options(case: Case) -> dict:
    return dict(temperature=case.temperature, softcap=case.softcap, shift=case.shift)


def outputs_and_grads(fn, h, w, y, b, seed: int = 1):
    """(log-probs, entropies, gradients of Σ g·logp + Σ k·H for fixed random g, k)."""
    logp, ent = fn(h, w, y, b)
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(logp.shape, generator=gen, dtype=torch.float64).to(logp.device)
    k = torch.randn(ent.shape, generator=gen, dtype=torch.float64).to(logp.device)
    leaves = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad((logp.double() * g).sum() + (ent.double() * k).sum(), leaves)
    return logp, ent, grads


def ours(case: Case, backend: str):
    return lambda h, w, y, b: fusedloss.linear_log_probs(
        h, w, y, linear_bias=b, return_entropy=True, backend=backend, **options(case))


def reference(case: Case):
    return lambda h, w, y, b: linear_log_probs_ref(h, w, y, linear_bias=b, **options(case))


def torch_same_dtype(case: Case):
    """What a trainer computes today: the logits in the input dtype, then fp32 softmax."""
    def run(h, w, y, b):
        if case.shift:
            h, y = h[..., :-1, :], y[..., 1:]
        z = F.linear(h, w, b).float()
        if case.softcap is not None:
            z = case.softcap * torch.tanh(z / case.softcap)
        logp_all = torch.log_softmax(z / case.temperature, dim=-1)
        valid = y != -100
        picked = logp_all.gather(-1, torch.where(valid, y, 0)[..., None])[..., 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return torch.where(valid, picked, 0.0), torch.where(valid, entropy, 0.0)
    return run


def check(case: Case, backend: str) -> None:
    note_case(repr(case))
    h, w, y, b = make(case)
    ref = outputs_and_grads(reference(case), h, w, y, b)
    got = outputs_and_grads(ours(case, backend), h, w, y, b)
    names = ["log_probs", "entropy", "d input", "d weight", "d bias"]
    if case.dtype == torch.float64:
        for name, x, r in zip(names, (got[0], got[1], *got[2]), (ref[0], ref[1], *ref[2]),
                              strict=False):
            torch.testing.assert_close(x.double(), r.double(), rtol=1e-9, atol=1e-9,
                                       msg=lambda m, n=name: f"{n}: {m}")
        return
    if case.v == 1:
        check_one_class(case, h, w, y, b, got, ref)
        return
    theirs = outputs_and_grads(torch_same_dtype(case), h, w, y, b)
    factor, floor, entropy_floor = accuracy_bar(case, h, w, y, b, ref)
    for name, x, t, r in zip(names, (got[0], got[1], *got[2]), (theirs[0], theirs[1], *theirs[2]),
                             (ref[0], ref[1], *ref[2]), strict=False):
        assert x.dtype == (t.dtype if name.startswith("d ") else torch.float32)
        extra = floor + (entropy_floor if name == "entropy" else 0.0)
        assert_close_to_ref(x, t, r, factor=factor, floor=default_floor(x) + extra, name=name)


def check_one_class(case: Case, h, w, y, b, got, ref) -> None:
    """A vocabulary of one: every log-prob and entropy is 0 and every gradient exactly zero,
    the difference of two equal terms (the target's logit and the log-sum-exp). Ours forms
    P_y − 1 from a recomputed logit and the saved log-sum-exp, which may sit an fp32 ulp of the
    logit apart (``accuracy_bar``'s confident rows): a gradient of a few eps32·|z| times the
    terms it cancels, the gradients of Σ (g + k)·z_y / T, where PyTorch's log-softmax of one
    column is exactly 0."""
    for name, x in zip(["log_probs", "entropy"], got[:2], strict=True):
        assert x.dtype == torch.float32
        assert not x.detach().any(), f"{name}: {x}"
    terms = outputs_and_grads(target_logits(case), h, w, y, b)[2]
    with torch.no_grad():
        z = F.linear(h.double(), w.double(), None if b is None else b.double())
    eps32 = torch.finfo(torch.float32).eps
    allowance = 8 * eps32 * (1 + float(z.abs().max()) / case.temperature)
    names = ["d input", "d weight", "d bias"]
    for name, x, r, term in zip(names, got[2], ref[2], terms, strict=False):
        assert x.dtype == case.dtype
        err = float(torch.linalg.vector_norm((x.double() - r.double()).cpu()))
        bound = allowance * float(torch.linalg.vector_norm(term.double().cpu()))
        assert err <= bound, f"{name}: error {err:.3e} on a zero gradient, bound {bound:.3e}"


def target_logits(case: Case):
    """z_y / T of each valid row (0 elsewhere) in float64, as (log-probs, entropies) stand-ins."""
    def run(h, w, y, b):
        if case.shift:
            h, y = h[..., :-1, :], y[..., 1:]
        z = F.linear(h.double(), w.double(), None if b is None else b.double())
        if case.softcap is not None:
            z = case.softcap * torch.tanh(z / case.softcap)
        valid = y != -100
        picked = z.gather(-1, torch.where(valid, y, 0)[..., None])[..., 0] / case.temperature
        picked = torch.where(valid, picked, 0.0)
        return picked, picked
    return run


def accuracy_bar(case: Case, h, w, y, b, ref) -> tuple[float, float, float]:
    """(factor, floor, the entropy's extra floor): the library's bar (1.5 × PyTorch's error),
    with the allowances that ``test_linear_cross_entropy.accuracy_bar`` derives for the same
    head:

    - fp32 with softcap: factor 4 (where tanh saturates, 1 − tanh² is formed from the capped
      logit, rounded twice, where PyTorch's autograd uses tanh itself: its item 3);
    - a row's own factors (its coefficients over its Σ exp) carry a few fp32 ulps that its
      whole row shares, which average over rows only: 4·eps32 / rows (its item 6);
    - a confident row's target entry of dX, −g·(P_y − 1), is formed from rounded terms of
      size |g|·P_y against a row gradient of size |g|·(1 − P_y): which of PyTorch's rounding
      and ours lands closer is chance (its item 4), a relative error of
      4·eps32·‖P_y‖ / ‖1 − P_y‖ over the rows;
    - every fp32 logit is rounded, in PyTorch's product and division by T as in ours (the
      product times 1/T, itself rounded), not alike: P moves by ~eps32·|X| relative (its item
      5), 2·eps32·rms(X);
    - an entropy is formed as log Σ − C / Σ, each with an absolute error of a few eps32, where
      a confident row's entropy is far below 1: 4·eps32·√rows / ‖H‖ for the entropy.
    """
    eps32 = torch.finfo(torch.float32).eps
    factor = 4.0 if case.dtype == torch.float32 and case.softcap else 1.5
    if case.shift:
        h, y = h[..., :-1, :], y[..., 1:]
    valid = y != -100
    rows = int(valid.sum())
    if rows == 0:
        return factor, 0.0, 0.0
    with torch.no_grad():
        x = h[valid].double() @ w.double().T + (b.double() if b is not None else 0.0)
        if case.softcap is not None:
            x = case.softcap * torch.tanh(x / case.softcap)
        rms_logit = float(x.div(case.temperature).square().mean().sqrt())
    p_target = ref[0].detach()[valid].exp()
    confident = torch.linalg.vector_norm(p_target) / torch.linalg.vector_norm(1 - p_target)
    entropy_norm = float(torch.linalg.vector_norm(ref[1].detach()[valid]))
    floor = 4 * eps32 / rows + 4 * eps32 * float(confident) + 2 * eps32 * rms_logit
    entropy_floor = 4 * eps32 * rows**0.5 / entropy_norm if entropy_norm > 0 else 0.0
    return factor, floor, entropy_floor


@st.composite
def cases(draw, lengths, vocabs, widths, dtypes):
    shift = draw(st.booleans())
    lead = (draw(st.integers(1, 3)), draw(st.sampled_from(lengths))) if shift else (
        draw(st.sampled_from(lengths)),)
    return Case(
        lead=lead, v=draw(st.sampled_from(vocabs)), d=draw(st.sampled_from(widths)),
        dtype=draw(st.sampled_from(dtypes)),
        temperature=draw(st.sampled_from([1.0, 0.7, 1.6, 0.05])),
        softcap=draw(st.sampled_from([None, None, 4.0])), bias=draw(st.booleans()), shift=shift,
        ignore_fraction=draw(st.sampled_from([0.0, 0.3, 1.0])), peaked=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@given(case=cases(lengths=[1, 5, 37, 130], vocabs=[1, 7, 123, 1000], widths=[1, 16, 48],
                  dtypes=[torch.float64, torch.float32]))
def test_torch_backend_matches_reference(case):
    check(case, "torch")


TRITON_DTYPES = [torch.float32, torch.bfloat16, torch.float16] if ON_GPU else [torch.float32]


@requires_triton
@settings(max_examples=TRITON_EXAMPLES)
@given(case=cases(lengths=[1, 7, 37] if not ON_GPU else [1, 37, 1031],
                  vocabs=[1, 7, 300] if not ON_GPU else [1, 123, 5003],
                  widths=[7, 16] if not ON_GPU else [16, 200], dtypes=TRITON_DTYPES))
def test_triton_backend_matches_reference(case):
    check(case, "triton")


@pytest.mark.slow
@requires_triton
def test_triton_many_column_splits():
    """Few rows and a wide vocabulary: the forward splits the columns over programs and merges
    each row's centered sums across them."""
    check(Case(lead=(3,), v=2000, d=16, dtype=torch.float32, temperature=0.8), "triton")
    check(Case(lead=(16,), v=2000, d=16, dtype=torch.float32, peaked=True), "triton")


# ---------------------------------------------------------------------------------------------
# each option changes the result as it should


def test_equals_negative_cross_entropy():
    h, w, y, b = make(Case(lead=(4, 9), v=50, d=8, dtype=torch.float64, bias=True,
                           ignore_fraction=0.3))
    logp = fusedloss.linear_log_probs(h, w, y, linear_bias=b, shift=True)
    ce = fusedloss.linear_cross_entropy(h, w, y, linear_bias=b, shift=True, reduction="none")
    torch.testing.assert_close(logp, -ce)
    assert logp.shape == (4, 8)


@pytest.mark.parametrize("option", ["temperature", "softcap", "linear_bias", "shift",
                                    "ignore_index"])
def test_every_option_is_applied(option):
    case = Case(lead=(2, 6), v=40, d=8, dtype=torch.float64, bias=True)
    h, w, y, b = make(case)
    value = dict(temperature=0.5, softcap=2.0, linear_bias=b, shift=True,
                 ignore_index=int(y[0, 0]))[option]
    got = fusedloss.linear_log_probs(h, w, y, **{option: value}, return_entropy=True)
    want = linear_log_probs_ref(h, w, y, **{option: value})
    plain = linear_log_probs_ref(h, w, y)
    for x, r, p in zip(got, want, plain, strict=True):
        torch.testing.assert_close(x, r)
        assert x.shape != p.shape or not torch.allclose(x, p)


def test_return_entropy_off_returns_the_log_probs_alone():
    h, w, y, _ = make(Case(lead=(5,), v=20, d=8, dtype=torch.float64))
    logp = fusedloss.linear_log_probs(h, w, y)
    assert isinstance(logp, torch.Tensor) and logp.shape == (5,)
    torch.testing.assert_close(logp, linear_log_probs_ref(h, w, y)[0])


def test_only_entropy_gets_a_gradient():
    """The entropy alone in the loss: the log-probs' gradient is absent, not zero-filled."""
    h, w, y, _ = make(Case(lead=(6,), v=30, d=8, dtype=torch.float64, temperature=0.9))
    _, ent = fusedloss.linear_log_probs(h, w, y, temperature=0.9, return_entropy=True)
    _, ref_ent = linear_log_probs_ref(h, w, y, temperature=0.9)
    got = torch.autograd.grad(ent.sum(), (h, w))
    want = torch.autograd.grad(ref_ent.sum(), (h, w))
    for x, r in zip(got, want, strict=True):
        torch.testing.assert_close(x, r)


def test_all_ignored_gives_zeros_and_zero_gradients():
    h, w, y, b = make(Case(lead=(2, 5), v=30, d=8, dtype=torch.float32, bias=True,
                           ignore_fraction=1.0))
    logp, ent = fusedloss.linear_log_probs(h, w, y, linear_bias=b, return_entropy=True)
    assert not logp.any() and not ent.any()
    grads = torch.autograd.grad(logp.sum() + ent.sum(), (h, w, b))
    assert all(not g.any() for g in grads)


def test_empty_input():
    h = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    logp, ent = fusedloss.linear_log_probs(h, w, torch.zeros(0, dtype=torch.long),
                                           return_entropy=True)
    assert logp.shape == ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert h.grad.shape == h.shape and not w.grad.any()


def test_nan_in_gives_nan_out():
    h, w, y, _ = make(Case(lead=(4,), v=20, d=8, dtype=torch.float32))
    with torch.no_grad():
        h[1, 2] = float("nan")
    logp, ent = fusedloss.linear_log_probs(h, w, y, return_entropy=True)
    assert logp[1].isnan() and ent[1].isnan()
    assert torch.isfinite(logp[[0, 2, 3]]).all()


def test_target_out_of_range_gives_nan(tune):
    h, w, y, _ = make(Case(lead=(4,), v=20, d=8, dtype=torch.float32))
    y[2] = 20
    logp, ent = fusedloss.linear_log_probs(h, w, y, return_entropy=True)
    assert logp[2].isnan() and ent[2].isnan() and torch.isfinite(logp[[0, 1, 3]]).all()
    (g,) = torch.autograd.grad(logp.sum(), (w,))
    assert g.isnan().any()
    tune(check_values=True)
    with pytest.raises(ValueError, match="outside"):
        fusedloss.linear_log_probs(h, w, y)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature=torch.tensor(0.5)), TypeError, "temperature"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(backend="cuda"), ValueError, "backend"),
])
def test_bad_options_are_named(kwargs, error, match):
    h, w, y, _ = make(Case(lead=(4,), v=20, d=8, dtype=torch.float32))
    with pytest.raises(error, match=match):
        fusedloss.linear_log_probs(h, w, y, **kwargs)


def test_bad_tensors_are_named():
    h, w, y, _ = make(Case(lead=(4,), v=20, d=8, dtype=torch.float32))
    with pytest.raises(TypeError, match="target"):
        fusedloss.linear_log_probs(h, w, y.float())
    with pytest.raises(ValueError, match="target"):
        fusedloss.linear_log_probs(h, w, y[:3])
    with pytest.raises(ValueError, match="input"):
        fusedloss.linear_log_probs(h[:, :5], w, y)
    with pytest.raises(TypeError, match="linear_weight"):
        fusedloss.linear_log_probs(h, w.double(), y)
    with pytest.raises(ValueError, match="linear_bias"):
        fusedloss.linear_log_probs(h, w, y, linear_bias=torch.zeros(3))
    with pytest.raises(ValueError, match="shift"):
        fusedloss.linear_log_probs(h[0], w, y[0], shift=True)


def test_autocast_casts_the_operands():
    """Under bf16 autocast the operands are cast as ``F.linear``'s: the result is within the
    bar of PyTorch's bf16 log-probs, against float64 of the bf16 operands (the Triton path
    rounds the logits to bf16 as ``F.linear`` does, the torch path keeps them in fp32)."""
    h, w, y, _ = make(Case(lead=(64,), v=300, d=32, dtype=torch.float32))
    with torch.autocast(h.device.type, dtype=torch.bfloat16):
        logp = fusedloss.linear_log_probs(h, w, y)
        theirs = F.linear(h, w).float().log_softmax(-1).gather(-1, y[:, None])[:, 0]
    want = linear_log_probs_ref(h.bfloat16(), w.bfloat16(), y)[0]
    assert logp.dtype == torch.float32
    assert_close_to_ref(logp, theirs, want, name="log p under autocast")


def test_compiles_with_fullgraph():
    case = Case(lead=(2, 7), v=37, d=16, dtype=torch.float32, temperature=0.7, bias=True,
                shift=True, ignore_fraction=0.3)
    fn = ours(case, "auto")
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    h, w, y, b = make(case)
    got, want = outputs_and_grads(compiled, h, w, y, b), outputs_and_grads(fn, h, w, y, b)
    for x, r in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2]), strict=True):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@requires_triton
def test_triton_is_deterministic():
    case = Case(lead=(37,), v=300, d=16, dtype=torch.float32, temperature=0.7)
    first = outputs_and_grads(ours(case, "triton"), *make(case))
    second = outputs_and_grads(ours(case, "triton"), *make(case))
    for x, r in zip((first[0], first[1], *first[2]), (second[0], second[1], *second[2]),
                    strict=True):
        assert torch.equal(x, r)


# ---------------------------------------------------------------------------------------------
# the Triton path in chunks of rows


@requires_triton
@pytest.mark.parametrize("rows", [1, 16])
def test_chunks_equal_one_call(rows, tune):
    """The Triton path in chunks of 1 or 16 rows (``Tuning.lm_head_chunk_bytes``) gives the
    one-chunk outputs and gradients: each chunk reads its own rows' statistics and upstream
    gradients."""
    case = Case(lead=(70,), v=50, d=16, dtype=torch.float32, temperature=0.8, bias=True,
                ignore_fraction=0.3)
    one = outputs_and_grads(ours(case, "triton"), *make(case))
    tune(lm_head_chunk_bytes=rows * case.v * 4)
    chunked = outputs_and_grads(ours(case, "triton"), *make(case))
    for x, r in zip((chunked[0], chunked[1], *chunked[2]), (one[0], one[1], *one[2]),
                    strict=True):
        assert rel_err(x, r) < 1e-6


# ---------------------------------------------------------------------------------------------
# the op's metrics for TRL's head (fusedloss.integrations.trl): log Σ p², the mean logit


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("n, v", [(37, 300), (3, 2000)], ids=["rows", "column-splits"])
def test_op_metrics_match_float64(backend, n, v):
    from fusedloss.ops import log_probs as ops

    h, w, y, b = make(Case(lead=(n,), v=v, d=16, dtype=torch.float32, bias=True))
    scale, temperature, cap = 0.8, 0.7, 6.0
    out = ops.linear_log_probs(h.detach(), w.detach(), y, b.detach(), -100, scale, temperature,
                               cap, True, True, True, backend)
    z = (h.double() @ w.double().T + b.double()) * scale
    x = cap * torch.tanh(z / cap) / temperature
    logp_all = x.log_softmax(-1)
    want = (logp_all.gather(-1, y[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1),
            torch.logsumexp(2 * logp_all, -1), x.mean(-1))
    for name, got, ref in zip(("log p", "entropy", "log sum p^2", "mean logit"), out[:4], want,
                              strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # not asked for: empty
    out = ops.linear_log_probs(h.detach(), w.detach(), y, None, -100, 1.0, 1.0, None, False,
                               False, False, backend)
    assert out[1].numel() == out[2].numel() == out[3].numel() == 0


@requires_triton
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_triton_op_outputs_equal_the_torch_backends(softcap):
    """Every output of the op on the Triton path (log p, H, log Σp², the mean logit, with a
    logit scale, a temperature, a soft-cap, a bias, ignored tokens and a target outside the
    vocabulary) and the gradients equal the torch backend's."""
    from fusedloss.ops import log_probs as ops

    gen = torch.Generator().manual_seed(3)
    n, v, d = 29, 45, 16
    h = torch.randn(n, d, generator=gen)
    w = torch.randn(v, d, generator=gen) / 2
    b = torch.randn(v, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    y[::5] = -100
    y[7] = v + 3  # outside: NaN for that token and the gradients
    results = {}
    for backend in ("torch", "triton"):
        leaves = [t.to(DEVICE).requires_grad_() for t in (h, w, b)]
        run = functools.partial(ops.linear_log_probs, leaves[0], leaves[1])
        options = (leaves[2], -100, 0.5, 0.7, softcap, True, True, True, backend)
        out = run(y.to(DEVICE), *options)[:4]
        # the gradients without the bad target (it makes them all NaN)
        good = run(torch.where(y > v, 1, y).to(DEVICE), *options)
        upstream = torch.linspace(-1, 1, n, device=DEVICE)
        loss = (good[0] * upstream).sum() + (good[1] * upstream.flip(0)).sum()
        results[backend] = ([x.detach() for x in out], torch.autograd.grad(loss, leaves))
    (out_t, grads_t), (out_k, grads_k) = results["torch"], results["triton"]
    for name, x, r in zip(("log p", "H", "log Σp²", "mean logit"), out_k, out_t, strict=True):
        assert bool(x[7].isnan()) and bool(r[7].isnan()), name
        assert not x[torch.arange(n) != 7].isnan().any(), name
        torch.testing.assert_close(x, r, rtol=2e-5, atol=2e-5, equal_nan=True, msg=name)
    for name, x, r in zip(("d input", "d weight", "d bias"), grads_k, grads_t, strict=True):
        assert not r.isnan().any()
        torch.testing.assert_close(x, r, rtol=1e-4, atol=1e-5, msg=name)
