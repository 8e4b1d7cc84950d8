"""Bad input gets a clear error that names the offending argument, before any work is done.

Values found only inside tensors (a target outside [0, V), a vocab_order that is not a
permutation) are checked on the device without a wait for it: they make the loss and the
gradients NaN, and ``Tuning.check_values`` raises the named error instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_to_ref, can_run_triton, run_on_cpu_without_interpreter

import fusedloss
from fusedloss import LinearCrossEntropyLoss, linear_cross_entropy

N, V, D = 7, 11, 5


def good(**overrides) -> dict:
    """Valid arguments of ``linear_cross_entropy`` (CPU, fp32), with some replaced."""
    g = torch.Generator().manual_seed(0)
    args = dict(
        input=torch.randn(N, D, generator=g),
        linear_weight=torch.randn(V, D, generator=g),
        target=torch.randint(0, V, (N,), generator=g),
    )
    args.update(overrides)
    return args


def call(**overrides):
    args = good(**overrides)
    return linear_cross_entropy(args.pop("input"), args.pop("linear_weight"),
                                args.pop("target"), **args)


def assert_pytorch_loss(loss, *, shift=False, ignore_index=-100, **overrides):
    """``loss`` is PyTorch's mean cross-entropy of ``good(**overrides)``: against the float64
    value, no worse than PyTorch's own float32 result (the library's accuracy rule)."""
    args = good(**overrides)
    x, w, t = args["input"], args["linear_weight"], args["target"]
    if shift:
        x, t = x[..., :-1, :], t[..., 1:]
    theirs, ref = (F.cross_entropy((x.to(dtype) @ w.to(dtype).T).reshape(-1, V), t.reshape(-1),
                                   ignore_index=ignore_index)
                   for dtype in (torch.float32, torch.float64))
    assert_close_to_ref(loss, theirs, ref, name="loss")


def test_good_arguments_work():
    assert_pytorch_loss(call())


# ---------------------------------------------------------------------------------------------
# shapes and dtypes

BAD_SHAPES = [
    pytest.param(dict(input=torch.randn(N, D + 1)), ValueError, r"input must be \(\*, D\)",
                 id="input-width"),
    pytest.param(dict(input=torch.randn(())), ValueError, "input", id="input-scalar"),
    pytest.param(dict(linear_weight=torch.randn(V * D)), ValueError,
                 r"linear_weight must be \(V, D\)", id="weight-1d"),
    # PyTorch's K-dimensional weight (C, d1, D): the targets must then be (N, d1).
    pytest.param(dict(linear_weight=torch.randn(2, V, D)), ValueError,
                 "target must have shape .* K-dimensional linear_weight", id="weight-3d"),
    pytest.param(dict(linear_weight=torch.randn(0, D)), ValueError, "linear_weight",
                 id="weight-empty-vocab"),
    pytest.param(dict(target=torch.zeros(N + 1, dtype=torch.long)), ValueError,
                 "target must have shape", id="target-length"),
    pytest.param(dict(target=torch.zeros(1, N, dtype=torch.long)), ValueError,
                 "target must have shape", id="target-rank"),
    pytest.param(dict(linear_bias=torch.randn(V + 1)), ValueError, "linear_bias",
                 id="bias-length"),
    pytest.param(dict(linear_bias=torch.randn(1, V)), ValueError, "linear_bias",
                 id="bias-2d"),
    pytest.param(dict(weight=torch.rand(V - 1)), ValueError, "weight must have shape",
                 id="class-weight-length"),
]


@pytest.mark.parametrize("overrides, error, message", BAD_SHAPES)
def test_bad_shapes(overrides, error, message):
    with pytest.raises(error, match=message):
        call(**overrides)


BAD_DTYPES = [
    pytest.param(dict(input=torch.zeros(N, D, dtype=torch.long)), "input", id="input-int"),
    pytest.param(dict(input=torch.randn(N, D, dtype=torch.complex64),
                      linear_weight=torch.randn(V, D, dtype=torch.complex64)),
                 "input must be float32, bfloat16, float16 or float64", id="input-complex"),
    pytest.param(dict(linear_weight=torch.randn(V, D, dtype=torch.bfloat16)), "linear_weight",
                 id="weight-dtype-mismatch"),
    pytest.param(dict(target=torch.zeros(N)), "target", id="target-float"),
    pytest.param(dict(target=torch.zeros(N, dtype=torch.bool)), "target", id="target-bool"),
    pytest.param(dict(linear_bias=torch.zeros(V, dtype=torch.long)), "linear_bias",
                 id="bias-int"),
    pytest.param(dict(weight=torch.ones(V, dtype=torch.long)), "weight", id="class-weight-int"),
]


@pytest.mark.parametrize("overrides, message", BAD_DTYPES)
def test_bad_dtypes(overrides, message):
    with pytest.raises(TypeError, match=message):
        call(**overrides)


@pytest.mark.parametrize("name", ["input", "linear_weight", "target"])
def test_non_tensor_arguments(name):
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
        call(**{name: [[1.0] * D] * N})


@pytest.mark.parametrize("name", ["linear_bias", "weight"])
def test_non_tensor_optional_arguments(name):
    with pytest.raises(TypeError, match=name):
        call(**{name: [1.0] * V})


# ---------------------------------------------------------------------------------------------
# devices: the meta device stands in for a second device on a CPU-only machine


@pytest.mark.parametrize("name", ["input", "linear_weight", "target", "linear_bias", "weight"])
def test_device_mismatch_names_the_tensor(name):
    args = good(linear_bias=torch.randn(V), weight=torch.rand(V))
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=rf"one device.*{name} on meta"):
        call(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch_cuda():
    with pytest.raises(ValueError, match="linear_weight on cuda"):
        call(linear_weight=torch.randn(V, D, device="cuda"))


# ---------------------------------------------------------------------------------------------
# target values


def _nan_at_row_3(**overrides):
    """The per-token losses of ``call(**overrides)``: NaN at row 3 only, the others the
    same call's with a good target there; the gradients NaN."""
    x = good()["input"].requires_grad_()
    loss = call(input=x, reduction="none", **overrides)
    assert torch.isnan(loss[3]) and torch.isfinite(loss[torch.arange(N) != 3]).all()
    fixed = dict(overrides, target=overrides["target"].clone())
    fixed["target"][3] = 0
    torch.testing.assert_close(loss[torch.arange(N) != 3],
                               call(reduction="none", **fixed)[torch.arange(N) != 3])
    loss.nan_to_num().sum().backward()
    assert torch.isnan(x.grad).any()


@pytest.mark.parametrize("bad", [V, V + 5, -1, -101], ids=["V", "V+5", "-1", "-101"])
def test_target_outside_vocabulary(bad, tune):
    target = torch.zeros(N, dtype=torch.long)
    target[3] = bad
    _nan_at_row_3(target=target)
    tune(check_values=True)
    with pytest.raises(ValueError, match=rf"target holds {bad}, outside \[0, {V}\)"):
        call(target=target)


@pytest.mark.parametrize("bad", [V + 5, -7], ids=["V+5", "-7"])
def test_target_outside_vocabulary_with_class_weights(bad, tune):
    # The class weights' gather must stay in bounds.
    target = torch.zeros(N, dtype=torch.long)
    target[3] = bad
    _nan_at_row_3(target=target, weight=torch.rand(V))
    tune(check_values=True)
    with pytest.raises(ValueError, match=rf"target holds {bad}, outside"):
        call(target=target, weight=torch.rand(V))


def test_target_equal_to_a_custom_ignore_index_is_fine(tune):
    target = torch.zeros(N, dtype=torch.long)
    target[3] = -1
    assert_pytorch_loss(call(target=target, ignore_index=-1), target=target, ignore_index=-1)
    assert torch.isnan(call(target=torch.full((N,), -100), ignore_index=-1))
    tune(check_values=True)
    with pytest.raises(ValueError, match="ignore_index=-1"):
        call(target=torch.full((N,), -100), ignore_index=-1)


def test_shift_ignores_the_first_target():
    """With shift the first position's target is never predicted: any value is accepted, and
    the loss is PyTorch's over the shifted positions, the same as with an in-range value."""
    g = torch.Generator().manual_seed(1)
    args = dict(input=torch.randn(2, N, D, generator=g), target=torch.randint(0, V, (2, N),
                                                                              generator=g))
    in_range = call(**args, shift=True)
    args["target"][:, 0] = 10 * V
    loss = call(**args, shift=True)
    assert torch.equal(loss, in_range)
    assert_pytorch_loss(loss, shift=True, **args)


# ---------------------------------------------------------------------------------------------
# options

BAD_OPTIONS = [
    pytest.param(dict(reduction="avg"), "reduction", id="reduction-avg"),
    pytest.param(dict(reduction=None), "reduction", id="reduction-None"),
    pytest.param(dict(label_smoothing=-0.1), "label_smoothing", id="label-smoothing-negative"),
    pytest.param(dict(label_smoothing=1.5), "label_smoothing", id="label-smoothing-above-1"),
    pytest.param(dict(label_smoothing=float("nan")), "label_smoothing", id="label-smoothing-nan"),
    pytest.param(dict(softcap=0.0), "softcap", id="softcap-0"),
    pytest.param(dict(softcap=-30.0), "softcap", id="softcap-negative"),
    pytest.param(dict(softcap=float("inf")), "softcap", id="softcap-inf"),
    pytest.param(dict(softcap=float("nan")), "softcap", id="softcap-nan"),
    pytest.param(dict(z_loss=-1e-4), "z_loss", id="z-loss-negative"),
    pytest.param(dict(z_loss=float("nan")), "z_loss", id="z-loss-nan"),
    pytest.param(dict(backend="cuda"), "backend", id="backend-unknown"),
    pytest.param(dict(backend="Triton"), "backend", id="backend-case"),
    pytest.param(dict(input=torch.randn(D), target=torch.tensor(0), shift=True), "shift",
                 id="shift-without-time-dim"),
    pytest.param(dict(input=torch.randn(2, 0, D), target=torch.zeros(2, 0, dtype=torch.long),
                      shift=True), "shift", id="shift-zero-length"),
]


@pytest.mark.parametrize("overrides, message", BAD_OPTIONS)
def test_bad_options(overrides, message):
    with pytest.raises(ValueError, match=message):
        call(**overrides)


def backend_params():
    """Both backends; "triton" on CPU tensors needs the interpreter, else it is skipped."""
    return [
        pytest.param("torch", id="torch"),
        pytest.param("triton", id="triton", marks=pytest.mark.skipif(
            not can_run_triton(), reason="needs a CUDA device or TRITON_INTERPRET=1")),
    ]


def on_device(backend: str, **overrides) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = good(**overrides)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


# filter_eps and vocab_order only matter to the Triton backend, but a bad value is a bug in
# the caller's code whichever backend runs it: it must not pass on CPU and fail on a GPU.
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("filter_eps", ["bogus", -1e-3, float("nan")],
                         ids=["bogus", "negative", "nan"])
def test_bad_filter_eps(backend, filter_eps):
    args = on_device(backend)
    x = args.pop("input").requires_grad_()
    with pytest.raises(ValueError, match="filter_eps"):
        linear_cross_entropy(x, args.pop("linear_weight"), args.pop("target"),
                             filter_eps=filter_eps, backend=backend)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize(
    "order",
    [
        pytest.param("sorted", id="unknown-string"),
        pytest.param(torch.arange(V - 1), id="too-short"),
        pytest.param(torch.arange(V).int(), id="int32"),
        pytest.param(list(range(V)), id="list"),
    ],
)
def test_bad_vocab_order(backend, order):
    args = on_device(backend)
    x = args.pop("input").requires_grad_()
    if isinstance(order, torch.Tensor):
        order = order.to(x.device)
    with pytest.raises((ValueError, TypeError), match="vocab_order"):
        linear_cross_entropy(x, args.pop("linear_weight"), args.pop("target"),
                             vocab_order=order, backend=backend)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize(
    "order",
    [
        pytest.param(torch.zeros(V, dtype=torch.long), id="not-a-permutation"),
        pytest.param(torch.arange(V).flip(0) + 1, id="out-of-range"),
    ],
)
def test_vocab_order_not_a_permutation(backend, order, tune):
    args = on_device(backend)
    x, w, y = args.pop("input").requires_grad_(), args.pop("linear_weight"), args.pop("target")
    order = order.to(x.device)
    loss = linear_cross_entropy(x, w, y, vocab_order=order, backend=backend)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(x.grad).all()
    tune(check_values=True)
    with pytest.raises(ValueError, match="vocab_order must be a permutation"):
        linear_cross_entropy(x, w, y, vocab_order=order, backend=backend)


def test_triton_on_cpu_without_interpreter_says_how_to_fix_it():
    """Without TRITON_INTERPRET, backend="triton" on CPU tensors fails clearly (in a fresh
    process: the variable must be unset before triton is imported)."""
    stdout = run_on_cpu_without_interpreter(
        """
        import torch
        import fusedloss
        x, w = torch.randn(3, 4), torch.randn(5, 4)
        y = torch.tensor([0, 1, 2])
        try:
            fusedloss.linear_cross_entropy(x, w, y, backend="triton")
        except RuntimeError as error:
            print("RuntimeError:", error)
        else:
            print("no error")
        print("auto:", fusedloss.linear_cross_entropy(x, w, y, backend="auto").item())
        """
    )
    assert "RuntimeError:" in stdout and "TRITON_INTERPRET=1" in stdout, stdout
    assert "backend='torch'" in stdout  # names the way out
    assert "auto:" in stdout  # "auto" falls back to the torch backend


# ---------------------------------------------------------------------------------------------
# the module validates at construction


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param(dict(reduction="avg"), "reduction", id="reduction"),
        pytest.param(dict(label_smoothing=2.0), "label_smoothing", id="label-smoothing"),
        pytest.param(dict(softcap=0.0), "softcap", id="softcap"),
        pytest.param(dict(vocab_order_every=0), "vocab_order_every", id="vocab-order-every-0"),
        pytest.param(dict(vocab_order_every=1.5), "vocab_order_every",
                     id="vocab-order-every-float"),
    ],
)
def test_module_rejects_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LinearCrossEntropyLoss(**kwargs)


@pytest.mark.parametrize("options, name", [
    (dict(z_loss=-1.0), "z_loss"), (dict(softcap=float("inf")), "softcap"),
    (dict(label_smoothing=1.5), "label_smoothing"), (dict(reduction="avg"), "reduction"),
    (dict(filter_eps=-1.0), "filter_eps"),
], ids=["z_loss", "softcap-inf", "label_smoothing", "reduction", "filter_eps"])
def test_module_validates_like_the_function(options, name):
    """The module rejects at construction what the function rejects at its call."""
    with pytest.raises(ValueError, match=name):
        LinearCrossEntropyLoss(**options)
    args = good()
    with pytest.raises(ValueError, match=name):
        linear_cross_entropy(args["input"], args["linear_weight"], args["target"], **options)


def test_public_api():
    assert sorted(fusedloss.__all__) == sorted([
        "ClipLoss", "InfoNCELoss", "LinearCrossEntropyLoss", "NTXentLoss", "SigLipLoss",
        "clip_loss", "info_nce_loss", "linear_cross_entropy", "linear_jsd", "linear_kl_div",
        "linear_log_probs", "linear_top_k_kl", "nt_xent_loss",
        "siglip_loss",
    ])
    for name in fusedloss.__all__:
        assert getattr(fusedloss, name).__doc__, f"{name} has no docstring"
