"""``fusedloss.linear_cross_entropy`` against PyTorch's own ``F.linear_cross_entropy``.

Every call PyTorch's function accepts (torch >= 2.13: ``input, linear_weight, target, *,
linear_bias, weight, reduction, ignore_index, label_smoothing, options``) must be accepted with
the same meaning: hypothesis draws calls over that whole signature — batched and single inputs,
class indices and class probabilities, K-dimensional weights, fp32 and float64, every option —
and compares losses and gradients. On a torch without the function (2.11), the comparison is
against the definition PyTorch's documentation gives for it (``F.linear`` then
``F.cross_entropy``), so the test runs everywhere.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, can_run_triton
from hypothesis import given
from hypothesis import strategies as st

import fusedloss

TORCH_FUNCTION = getattr(F, "linear_cross_entropy", None)
OPTIONS = getattr(torch.nn, "LinearCrossEntropyOptions", None)
BACKENDS = ("auto", "torch", "triton") if can_run_triton() else ("auto", "torch")


def pytorch_linear_cross_entropy(input, linear_weight, target, **kwargs):
    """PyTorch's function, or (torch < 2.13) the composition it is defined as."""
    if TORCH_FUNCTION is not None:
        return TORCH_FUNCTION(input, linear_weight, target, **kwargs)
    kwargs.pop("options", None)
    bias = kwargs.pop("linear_bias", None)
    ignore_index = kwargs.pop("ignore_index", None)
    c, *out, d = linear_weight.shape
    logits = F.linear(input, linear_weight.reshape(-1, d),
                      None if bias is None else bias.reshape(-1))
    logits = logits.reshape(*input.shape[:-1], c, *out)
    if ignore_index is not None:
        kwargs["ignore_index"] = ignore_index
    return F.cross_entropy(logits, target, **kwargs)


@st.composite
def calls(draw):
    """A call of PyTorch's signature: (input, linear_weight, target, keyword arguments, the
    backend of ours)."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    form = draw(st.sampled_from(["rows", "single", "k1", "k2"]))
    soft = draw(st.booleans())
    n, v, d = draw(st.integers(1, 6)), draw(st.integers(2, 9)), draw(st.integers(1, 8))
    out = {"rows": (), "single": (), "k1": (3,), "k2": (2, 2)}[form]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    lead = () if form == "single" else (n,)
    input = torch.randn(*lead, d, generator=g, dtype=dtype)
    weight = torch.randn(v, *out, d, generator=g, dtype=dtype) * 2
    kwargs = {}
    if soft:
        logits = torch.randn(*lead, v, *out, generator=g, dtype=dtype)
        target = torch.softmax(logits, dim=len(lead))
    else:
        target = torch.randint(0, v, (*lead, *out), generator=g)
        ignore = draw(st.sampled_from(["default", "explicit -100", "a class"]))
        if ignore == "explicit -100":
            kwargs["ignore_index"] = -100
        elif ignore == "a class":
            kwargs["ignore_index"] = 1
        ignored = kwargs.get("ignore_index", -100)
        if target.dim():
            target.view(-1)[torch.rand(target.numel(), generator=g) < 0.3] = ignored
            target.view(-1)[0] = 0  # one counted target (all ignored: PyTorch NaN, ours 0)
        elif ignore == "a class":
            target.fill_(0)
    if draw(st.booleans()):
        kwargs["linear_bias"] = torch.randn(v, *out, generator=g, dtype=dtype)
    if draw(st.booleans()):
        kwargs["weight"] = torch.rand(v, generator=g, dtype=dtype) + 0.5
    kwargs["reduction"] = draw(st.sampled_from(["mean", "sum", "none"]))
    kwargs["label_smoothing"] = draw(st.sampled_from([0.0, 0.25]))
    if OPTIONS is not None:
        kwargs["options"] = draw(st.sampled_from(
            [None, OPTIONS(), OPTIONS(batch_chunk_size=2, chunking_method=None)]))
    backend = draw(st.sampled_from(BACKENDS if dtype == torch.float32 else ("auto", "torch")))
    return input, weight, target, kwargs, backend


@pytest.mark.filterwarnings("ignore:linear_cross_entropy")  # PyTorch: "options ignored"
@given(call=calls())
def test_every_pytorch_call_gives_pytorchs_result(call):
    input, weight, target, kwargs, backend = call
    has_bias = "linear_bias" in kwargs
    results = []
    for fn, extra in ((pytorch_linear_cross_entropy, {}),
                      (fusedloss.linear_cross_entropy, {"backend": backend})):
        leaves = [t.clone().to(DEVICE).requires_grad_()
                  for t in (input, weight, *([kwargs["linear_bias"]] if has_bias else []))]
        kw = {k: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for k, t in kwargs.items()}
        if has_bias:
            kw["linear_bias"] = leaves[2]
        loss = fn(leaves[0], leaves[1], target.to(DEVICE), **kw, **extra)
        upstream = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype,
                                  device=loss.device).view(loss.shape)
        results.append((loss, torch.autograd.grad((loss * upstream).sum(), leaves)))
    (want, want_grads), (got, got_grads) = results
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = (dict(rtol=1e-10, atol=1e-12) if input.dtype == torch.float64
           else dict(rtol=2e-5, atol=2e-5))
    torch.testing.assert_close(got, want, **tol)
    for name, g_got, g_want in zip(["input", "linear_weight", "linear_bias"][:len(got_grads)],
                                   got_grads, want_grads, strict=True):
        torch.testing.assert_close(g_got, g_want, **tol, msg=lambda m, n=name: f"d {n}: {m}")


def test_signature_holds_pytorchs():
    """Each parameter of PyTorch's function is ours too, of the same kind and default (the
    rest of ours are keyword-only with defaults, so every PyTorch call binds)."""
    if TORCH_FUNCTION is None:
        pytest.skip("torch < 2.13 has no F.linear_cross_entropy")
    theirs = inspect.signature(TORCH_FUNCTION).parameters
    ours = inspect.signature(fusedloss.linear_cross_entropy).parameters
    for name, p in theirs.items():
        assert name in ours, name
        assert ours[name].kind == p.kind, name
        assert ours[name].default == p.default, name
    for name in set(ours) - set(theirs):
        assert ours[name].kind == inspect.Parameter.KEYWORD_ONLY, name
        assert ours[name].default is not inspect.Parameter.empty, name


def _small(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 3, generator=g, dtype=dtype), torch.randn(5, 3, generator=g,
            dtype=dtype), torch.tensor([0, 4, 2, 1]))


def test_positional_arguments_as_pytorch():
    h, w, y = _small()
    assert torch.equal(fusedloss.linear_cross_entropy(h, w, y),
                       fusedloss.linear_cross_entropy(input=h, linear_weight=w, target=y))
    with pytest.raises(TypeError):
        fusedloss.linear_cross_entropy(h, w, y, None)  # keyword-only from here, as PyTorch


def test_probabilities_refuse_ignore_index_as_pytorch():
    h, w, _ = _small()
    p = torch.softmax(torch.randn(4, 5), dim=-1)
    with pytest.raises(ValueError, match="ignore_index"):
        fusedloss.linear_cross_entropy(h, w, p, ignore_index=-100)
    for name, value in (("shift", True), ("softcap", 5.0)):
        with pytest.raises(ValueError, match=name):
            fusedloss.linear_cross_entropy(h[None], w, p[None], **{name: value})


def test_options_must_be_pytorchs():
    h, w, y = _small()
    with pytest.raises(TypeError, match="options"):
        fusedloss.linear_cross_entropy(h, w, y, options={"batch_chunk_size": 2})
    with pytest.raises(TypeError, match="options"):
        fusedloss.LinearCrossEntropyLoss(options="chunked")


def test_float64_runs_in_float64_and_refuses_the_kernels():
    h, w, y = (t.to(DEVICE) for t in _small(torch.float64))
    loss = fusedloss.linear_cross_entropy(h, w, y)
    assert loss.dtype == torch.float64
    exact = torch.nn.functional.cross_entropy(h @ w.T, y)
    assert abs(float(loss) - float(exact)) < 1e-14  # fp32 statistics would be ~1e-7 off
    with pytest.raises(ValueError, match="backend='triton'"):
        fusedloss.linear_cross_entropy(h, w, y, backend="triton")


def test_module_takes_pytorchs_defaults():
    h, w, y = _small()
    y = y.clone()
    y[1] = -100
    module = fusedloss.LinearCrossEntropyLoss()  # ignore_index None: -100, as PyTorch
    assert module.ignore_index is None
    torch.testing.assert_close(module(h, w, y), F.cross_entropy(h @ w.T, y))
    if OPTIONS is not None:
        y[1] = 3
        module = fusedloss.LinearCrossEntropyLoss(options=OPTIONS(), ignore_index=4)
        torch.testing.assert_close(module(h, w, y), F.cross_entropy(h @ w.T, y, ignore_index=4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_bias_and_class_weights(backend):
    """Views with a stride (one head's bias of a K-dimensional weight) give the result of
    their contiguous copies: the kernels read these vectors at unit stride."""
    h, w, y = (t.to(DEVICE) for t in _small())
    bias = torch.randn(5, 3, device=DEVICE)[:, 1]
    class_weight = (torch.rand(5, 2, device=DEVICE) + 0.5)[:, 0]
    got = fusedloss.linear_cross_entropy(h, w, y, linear_bias=bias, weight=class_weight,
                                         label_smoothing=0.1, backend=backend)
    want = F.cross_entropy(h @ w.T + bias, y, weight=class_weight, label_smoothing=0.1)
    torch.testing.assert_close(got, want)


PROBABILITIES = torch.softmax(torch.randn(4, 5, generator=torch.Generator().manual_seed(1)), -1)
COMPILED_FORMS = {
    "probabilities": lambda h, w, b: (h, w, PROBABILITIES.to(h.device),
                                      dict(linear_bias=b, label_smoothing=0.1)),
    "k-dimensional": lambda h, w, b: (h, w.reshape(5, 1, 3).expand(5, 2, 3) * torch.tensor(
        [1.0, -0.5], device=h.device)[None, :, None], torch.tensor([[0, 1], [4, 4], [2, -100],
                                                                     [1, 3]], device=h.device),
        dict(reduction="sum")),
    "float64": lambda h, w, b: (h.double(), w.double(), torch.tensor([0, 4, 2, 1],
                                device=h.device), dict(linear_bias=b.double())),
    "options": lambda h, w, b: (h, w, torch.tensor([0, 4, 2, 1], device=h.device),
                                dict(options=OPTIONS() if OPTIONS is not None else None,
                                     ignore_index=None)),
}


@pytest.mark.parametrize("form", list(COMPILED_FORMS))
def test_pytorch_forms_compile_fullgraph(form):
    """Each of PyTorch's forms of the call traces into one graph and gives the eager result."""
    h, w, _ = (t.to(DEVICE) for t in _small())
    bias = torch.randn(5, device=DEVICE)
    compiled = torch.compile(fusedloss.linear_cross_entropy, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (fusedloss.linear_cross_entropy, compiled):
        leaves = [t.clone().requires_grad_() for t in (h, w, bias)]
        hh, ww, target, kwargs = COMPILED_FORMS[form](*leaves)
        loss = fn(hh, ww, target, **kwargs)
        results.append((loss, torch.autograd.grad(loss.sum(), leaves, allow_unused=True)))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want)
    for g_got, g_want in zip(got_grads, want_grads, strict=True):
        assert (g_got is None) == (g_want is None)
        if g_want is not None:
            torch.testing.assert_close(g_got, g_want)
