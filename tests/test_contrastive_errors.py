"""Bad input to the contrastive losses gets a clear error that names the offending argument,
before any work is done: ``clip_loss``, ``info_nce_loss``, ``nt_xent_loss``, ``siglip_loss``,
their modules and their distributed forms. The one exception is a tensor scale or
temperature out of range, which is not read on the host: it gives NaN."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import (
    run_on_cpu_without_interpreter,
    triton_interpreter_enabled,
)
from workers import Raised, all_ok

import fusedloss
import fusedloss.distributed as fd
from fusedloss import (
    ClipLoss,
    InfoNCELoss,
    NTXentLoss,
    SigLipLoss,
    clip_loss,
    info_nce_loss,
    nt_xent_loss,
    reference,
    siglip_loss,
)

B, M, D = 6, 9, 5  # pairs / queries, keys, width


def features(rows: int = B, width: int = D, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(rows, width, generator=g), dim=1).to(dtype)


def call(loss: str, **overrides):
    """One call of ``loss`` with valid CPU fp32 arguments, some replaced."""
    if loss == "clip":
        args = dict(image_features=features(), text_features=features(seed=1), logit_scale=10.0)
        args.update(overrides)
        return clip_loss(args.pop("image_features"), args.pop("text_features"),
                         args.pop("logit_scale"), **args)
    if loss == "siglip":
        args = dict(image_features=features(), text_features=features(seed=1), logit_scale=10.0,
                    logit_bias=-10.0)
        args.update(overrides)
        return siglip_loss(args.pop("image_features"), args.pop("text_features"),
                           args.pop("logit_scale"), args.pop("logit_bias"), **args)
    if loss == "info_nce":
        args = dict(query=features(), keys=features(M, seed=1))
        args.update(overrides)
        return info_nce_loss(args.pop("query"), args.pop("keys"), **args)
    args = dict(features=features(2 * B))
    args.update(overrides)
    return nt_xent_loss(args.pop("features"), **args)


# The float64 references of ``call(loss)``'s defaults (temperatures: the functions' defaults).
REFERENCES = {
    "clip": lambda: reference.clip_loss_ref(features(), features(seed=1), 10.0),
    "siglip": lambda: reference.siglip_loss_ref(features(), features(seed=1), 10.0, -10.0),
    "info_nce": lambda: reference.info_nce_loss_ref(features(), features(M, seed=1),
                                                    temperature=0.07),
    "nt_xent": lambda: reference.nt_xent_loss_ref(features(2 * B), temperature=0.5),
}


@pytest.mark.parametrize("loss", ["clip", "siglip", "info_nce", "nt_xent"])
def test_good_arguments_work(loss):
    torch.testing.assert_close(call(loss).double(), REFERENCES[loss](), rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------
# features: shapes, dtypes, types

FEATURE_ARGS = [
    pytest.param("clip", "image_features", id="clip-image"),
    pytest.param("clip", "text_features", id="clip-text"),
    pytest.param("siglip", "image_features", id="siglip-image"),
    pytest.param("siglip", "text_features", id="siglip-text"),
    pytest.param("info_nce", "query", id="info_nce-query"),
    pytest.param("info_nce", "keys", id="info_nce-keys"),
    pytest.param("nt_xent", "features", id="nt_xent-features"),
]


@pytest.mark.parametrize("loss, name", FEATURE_ARGS)
@pytest.mark.parametrize("shape", [(B * D,), (2, B, D), ()], ids=["1d", "3d", "scalar"])
def test_wrong_rank(loss, name, shape):
    with pytest.raises(ValueError, match=rf"{name} must be 2-D \(batch, D\)"):
        call(loss, **{name: torch.randn(shape)})


@pytest.mark.parametrize("loss, name", FEATURE_ARGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool],
                         ids=["float64", "int64", "bool"])
def test_unsupported_dtype(loss, name, dtype):
    """float64 and integers are refused, whichever argument carries them (both float64: the
    dtype check, not the mismatch check, must fire)."""
    others = {"clip": ["image_features", "text_features"],
              "siglip": ["image_features", "text_features"], "info_nce": ["query", "keys"],
              "nt_xent": ["features"]}[loss]
    rows = {"keys": M, "features": 2 * B}
    bad = {n: features(rows.get(n, B)).to(dtype) for n in others}
    with pytest.raises(TypeError, match=f"{others[0]} must be float32, bfloat16 or float16"):
        call(loss, **bad)
    with pytest.raises(TypeError, match=f"{name} must be float32, bfloat16 or float16"):
        call(loss, **{name: features(rows.get(name, B)).to(dtype)})


@pytest.mark.parametrize("loss, first, second", [
    pytest.param("clip", "image_features", "text_features", id="clip"),
    pytest.param("siglip", "image_features", "text_features", id="siglip"),
    pytest.param("info_nce", "query", "keys", id="info_nce"),
])
def test_dtype_mismatch(loss, first, second):
    rows = M if second == "keys" else B
    with pytest.raises(TypeError, match=rf"{second} has dtype torch.bfloat16 but {first} has "
                       "torch.float32"):
        call(loss, **{second: features(rows).bfloat16()})


@pytest.mark.parametrize("loss", ["clip", "siglip"])
@pytest.mark.parametrize("text_shape", [(B + 1, D), (B - 1, D), (B, D + 1)],
                         ids=["more-texts", "fewer-texts", "wider"])
def test_pair_shape_mismatch(loss, text_shape):
    """Pair i is (image i, text i): a batch or width mismatch is an error naming both."""
    with pytest.raises(ValueError, match=r"image_features and text_features must have the same "
                       r"shape \(b, D\)"):
        call(loss, text_features=features(*text_shape))


def test_keys_width_mismatch():
    with pytest.raises(ValueError, match=r"keys must be \(M, D\) with D = query.shape\[1\]"):
        call("info_nce", keys=features(M, D + 1))


@pytest.mark.parametrize("loss, name", FEATURE_ARGS)
def test_empty_batch(loss, name):
    with pytest.raises(ValueError, match=f"{name} is empty"):
        call(loss, **{name: torch.zeros(0, D)})


@pytest.mark.parametrize("loss, name", FEATURE_ARGS)
def test_zero_width(loss, name):
    with pytest.raises(ValueError, match=f"{name} has width D = 0"):
        rows = {"keys": M, "features": 2 * B}.get(name, B)
        call(loss, **{name: torch.zeros(rows, 0)})


# The modules' forward arguments, by position (their errors name them as the functions do).
MODULE_FEATURES = {
    "clip": (lambda a, b: ClipLoss(backend="torch")(a, b, 10.0),
             ("image_features", "text_features")),
    "siglip": (lambda a, b: SigLipLoss(backend="torch")(a, b, 10.0, -10.0),
               ("image_features", "text_features")),
    "info_nce": (lambda a, b: InfoNCELoss(backend="torch")(a, b), ("query", "keys")),
    "nt_xent": (lambda a: NTXentLoss(backend="torch")(a), ("features",)),
    "nt_xent-two-views": (lambda a, b: NTXentLoss(backend="torch")(a, b),
                          ("features", "second_view")),
}


@pytest.mark.parametrize("module", list(MODULE_FEATURES))
@pytest.mark.parametrize("shape", [(0, D), (B, 0), (0, 0)], ids=["0-rows", "D=0", "0x0"])
def test_module_empty_inputs(module, shape):
    """0 rows or D = 0 in any feature argument of a module: the functions' ValueError."""
    fn, names = MODULE_FEATURES[module]
    for position, name in enumerate(names):
        args = [features(2 * B if module == "nt_xent" else B) for _ in names]
        args[position] = torch.zeros(shape)
        message = f"{name} is empty" if shape[0] == 0 else f"{name} has width D = 0"
        with pytest.raises(ValueError, match=message):
            fn(*args)


@pytest.mark.parametrize("loss, name", FEATURE_ARGS)
def test_non_tensor_features(loss, name):
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
        call(loss, **{name: [[1.0] * D] * B})


# ---------------------------------------------------------------------------------------------
# devices: the meta device stands in for a second device on a CPU-only machine


@pytest.mark.parametrize("loss, first, second", [
    pytest.param("clip", "image_features", "text_features", id="clip"),
    pytest.param("siglip", "image_features", "text_features", id="siglip"),
    pytest.param("info_nce", "query", "keys", id="info_nce"),
])
def test_device_mismatch(loss, first, second):
    rows = M if second == "keys" else B
    with pytest.raises(ValueError, match=f"{second} is on meta but {first} on cpu"):
        call(loss, **{second: features(rows).to("meta")})


@pytest.mark.parametrize("loss, name", [
    pytest.param("clip", "logit_scale", id="clip-scale"),
    pytest.param("clip", "logit_bias", id="clip-bias"),
    pytest.param("siglip", "logit_scale", id="siglip-scale"),
    pytest.param("siglip", "logit_bias", id="siglip-bias"),
    pytest.param("info_nce", "temperature", id="info_nce-temperature"),
    pytest.param("nt_xent", "temperature", id="nt_xent-temperature"),
    pytest.param("info_nce", "labels", id="info_nce-labels"),
])
def test_scalar_or_labels_on_another_device(loss, name):
    value = torch.arange(B) if name == "labels" else torch.tensor(0.5)
    with pytest.raises(ValueError, match=f"{name} is on meta"):
        call(loss, **{name: value.to("meta")})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch_cuda():
    with pytest.raises(ValueError, match="text_features is on cuda"):
        call("clip", text_features=features().cuda())


# ---------------------------------------------------------------------------------------------
# logit_scale, logit_bias, temperature


@pytest.mark.parametrize("loss", ["clip", "siglip"])
@pytest.mark.parametrize("name", ["logit_scale", "logit_bias"])
@pytest.mark.parametrize("shape", [(2,), (1, 3), (0,)], ids=["2", "1x3", "empty"])
def test_non_scalar_logit_scale_and_bias(loss, name, shape):
    with pytest.raises(ValueError, match=rf"{name} must be a scalar \(one element\)"):
        call(loss, **{name: torch.ones(shape)})


@pytest.mark.parametrize("loss", ["clip", "siglip", "info_nce", "nt_xent"])
@pytest.mark.parametrize("value", ["10", None, True, [10.0]], ids=["str", "None", "bool", "list"])
def test_scalar_of_the_wrong_type(loss, value):
    name = "temperature" if loss in ("info_nce", "nt_xent") else "logit_scale"
    with pytest.raises(TypeError, match=f"{name} must be a float or a one-element tensor"):
        call(loss, **{name: value})


def test_siglip_needs_a_bias():
    with pytest.raises(TypeError, match="logit_bias must be a float or a one-element tensor"):
        call("siglip", logit_bias=None)


@pytest.mark.parametrize("loss", ["clip", "siglip", "info_nce", "nt_xent"])
def test_integer_scalar_tensor(loss):
    name = "temperature" if loss in ("info_nce", "nt_xent") else "logit_scale"
    with pytest.raises(TypeError, match=f"{name} must be floating point"):
        call(loss, **{name: torch.tensor(2)})


SCALES = [
    pytest.param("clip", "logit_scale", id="clip-logit_scale"),
    pytest.param("siglip", "logit_scale", id="siglip-logit_scale"),
    pytest.param("info_nce", "temperature", id="info_nce-temperature"),
    pytest.param("nt_xent", "temperature", id="nt_xent-temperature"),
]
NOT_POSITIVE_OR_NOT_FINITE = [0.0, -0.07, 0, -2, math.nan, math.inf, -math.inf]
NUMBER_IDS = ["0.0", "negative", "int-0", "int-negative", "nan", "inf", "-inf"]


def scale_error(name: str, value) -> str:
    return re.escape(f"{name} must be > 0 and finite, got {float(value)}")


@pytest.mark.parametrize("loss, name", SCALES)
@pytest.mark.parametrize("value", NOT_POSITIVE_OR_NOT_FINITE, ids=NUMBER_IDS)
def test_scale_or_temperature_number_not_positive_and_finite(loss, name, value):
    with pytest.raises(ValueError, match=scale_error(name, value)):
        call(loss, **{name: value})


@pytest.mark.parametrize("module", ["clip", "siglip", "info_nce", "nt_xent"])
@pytest.mark.parametrize("value", NOT_POSITIVE_OR_NOT_FINITE, ids=NUMBER_IDS)
def test_module_scale_or_temperature_number_not_positive_and_finite(module, value):
    x = features()
    if module == "clip":
        name, make = "logit_scale", lambda: ClipLoss(backend="torch")(x, x, value)
    elif module == "siglip":
        name, make = "logit_scale", lambda: SigLipLoss(backend="torch")(x, x, value, -10.0)
    else:
        cls = InfoNCELoss if module == "info_nce" else NTXentLoss
        name, make = "temperature", lambda: cls(temperature=value)
    with pytest.raises(ValueError, match=scale_error(name, value)):
        make()


@pytest.mark.parametrize("loss", ["clip", "siglip"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_logit_bias_number_not_finite(loss, value):
    with pytest.raises(ValueError, match=re.escape(f"logit_bias must be finite, got {value}")):
        call(loss, logit_bias=value)


@pytest.mark.parametrize("loss", ["clip", "siglip"])
@pytest.mark.parametrize("value", [0.0, -3.0, 0], ids=["0.0", "negative", "int-0"])
def test_logit_bias_any_finite_number(loss, value):
    torch.testing.assert_close(call(loss, logit_bias=value).double(),
                               REFERENCES["clip"]() if loss == "clip" else
                               reference.siglip_loss_ref(features(), features(seed=1), 10.0,
                                                         value), rtol=1e-5, atol=0)


def first_features(loss: str) -> str:
    return {"clip": "image_features", "siglip": "image_features", "info_nce": "query",
            "nt_xent": "features"}[loss]


def backend_params():
    """Both backends; "triton" on these CPU tensors needs the interpreter, else it is skipped."""
    return [
        pytest.param("torch", id="torch"),
        pytest.param("triton", id="triton", marks=requires_interpreter),
    ]


# CPU tensors on the Triton backend: the kernels run there through the interpreter only (on a
# GPU machine, tests/test_host_sync.py holds the CUDA calls to no host reads).
requires_interpreter = pytest.mark.skipif(not triton_interpreter_enabled(),
                                          reason="CPU tensors: needs TRITON_INTERPRET=1")

TENSOR_VALUES = [0.0, -0.5, math.inf, -math.inf, math.nan]
TENSOR_IDS = ["0", "negative", "inf", "-inf", "nan"]


@pytest.mark.parametrize("loss, name", SCALES)
@pytest.mark.parametrize("value", TENSOR_VALUES, ids=TENSOR_IDS)
def test_tensor_scale_or_temperature_out_of_range_gives_nan(loss, name, value):
    """Not read on the host (no wait for the device): the loss and every gradient are NaN."""
    scalar = torch.tensor(value, requires_grad=True)
    x = features(2 * B if loss == "nt_xent" else B).requires_grad_()
    out = call(loss, **{name: scalar, first_features(loss): x})
    assert torch.isnan(out)
    out.backward()
    assert torch.isnan(scalar.grad) and torch.isnan(x.grad).all()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("loss, name", SCALES)
def test_tensor_scale_out_of_range_on_both_backends(loss, name, backend):
    """The NaN also passes the Triton kernels' filtering, on each loss."""
    scalar = torch.tensor(-0.5, requires_grad=True)
    x = features(2 * B if loss == "nt_xent" else B).requires_grad_()
    out = call(loss, backend=backend, **{name: scalar, first_features(loss): x})
    out.backward()
    assert torch.isnan(out) and torch.isnan(scalar.grad) and torch.isnan(x.grad).all()


@pytest.mark.parametrize("module", ["clip", "siglip"])
@pytest.mark.parametrize("value", TENSOR_VALUES, ids=TENSOR_IDS)
def test_module_tensor_scale_out_of_range_gives_nan(module, value):
    scalar = torch.tensor(value, requires_grad=True)
    x = features().requires_grad_()
    if module == "clip":
        out = ClipLoss(backend="torch")(x, features(seed=1), scalar)
    else:
        out = SigLipLoss(backend="torch")(x, features(seed=1), scalar, -10.0)
    out.backward()
    assert torch.isnan(out) and torch.isnan(scalar.grad) and torch.isnan(x.grad).all()


@pytest.mark.parametrize("loss, name", SCALES)
@pytest.mark.parametrize("value", [0.07, 10.3])
def test_tensor_scale_in_range_equals_the_number(loss, name, value):
    """The NaN guard leaves a valid tensor value exactly as it is, gradient included."""
    torch.testing.assert_close(call(loss, **{name: torch.tensor(value)}),
                               call(loss, **{name: value}), rtol=0, atol=0)
    scalar = torch.tensor(value, requires_grad=True)
    call(loss, **{name: scalar}).backward()
    leaf = torch.tensor(value, dtype=torch.float64, requires_grad=True)
    ref = {"clip": lambda: reference.clip_loss_ref(features(), features(seed=1), leaf),
           "siglip": lambda: reference.siglip_loss_ref(features(), features(seed=1), leaf, -10.0),
           "info_nce": lambda: reference.info_nce_loss_ref(features(), features(M, seed=1),
                                                           temperature=leaf),
           "nt_xent": lambda: reference.nt_xent_loss_ref(features(2 * B), temperature=leaf)}
    ref[loss]().backward()
    torch.testing.assert_close(scalar.grad.double(), leaf.grad, rtol=1e-4, atol=1e-6)


@requires_interpreter
@pytest.mark.parametrize("loss, name", SCALES)
def test_tensor_scale_is_not_read_on_the_host(loss, name, monkeypatch):
    """Reading a tensor's value on the host waits for the device (a sync, which
    tests/test_host_sync.py catches on CUDA); here, on any machine that runs the kernels: no
    tensor value is read at all, forward or backward (the torch backend reads its row count)."""
    scalar = torch.tensor(-0.5, requires_grad=True)

    def read(self, *args):
        raise AssertionError("a tensor value was read on the host")

    for method in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, method, read)
    out = call(loss, backend="triton", **{name: scalar})
    out.backward()
    monkeypatch.undo()
    assert torch.isnan(out)


def test_tensor_temperature_out_of_range_under_compile():
    """The guard is traced (fullgraph): NaN under torch.compile too."""
    fn = torch.compile(lambda z, t: nt_xent_loss(z, t), fullgraph=True, backend="aot_eager")
    assert torch.isnan(fn(features(2 * B), torch.tensor(-0.5)))


def test_temperature_non_scalar():
    with pytest.raises(ValueError, match=r"temperature must be a scalar \(one element\)"):
        call("info_nce", temperature=torch.full((2,), 0.1))


# ---------------------------------------------------------------------------------------------
# info_nce labels, nt_xent row count


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad", [M, M + 3, -1], ids=["M", "M+3", "-1"])
def test_labels_out_of_range_give_nan(bad, backend):
    """Found without a wait for the GPU: the bad row's loss is NaN, the others are the loss of
    the same call without it, and every gradient is NaN (never a finite wrong one)."""
    if backend == "triton" and not triton_interpreter_enabled():
        pytest.skip("the Triton backend on CPU tensors needs Triton's interpreter")
    labels = torch.zeros(B, dtype=torch.long)
    labels[2] = bad
    query = features().requires_grad_()
    keys = features(M, seed=1).requires_grad_()
    loss = info_nce_loss(query, keys, labels, reduction="none", backend=backend)
    assert torch.isnan(loss[2]) and torch.isfinite(loss[torch.arange(B) != 2]).all()
    good = info_nce_loss(query.detach(), keys.detach(), labels.clamp(0, M - 1),
                         reduction="none", backend=backend)
    torch.testing.assert_close(loss[torch.arange(B) != 2], good[torch.arange(B) != 2])
    loss.nan_to_num().sum().backward()  # even with the NaN row's own gradient masked
    assert torch.isnan(query.grad).any() and torch.isnan(keys.grad).any()


@pytest.mark.parametrize("bad", [M, M + 3, -1], ids=["M", "M+3", "-1"])
def test_labels_out_of_range_raise_when_checked(bad, tune):
    tune(check_values=True)
    labels = torch.zeros(B, dtype=torch.long)
    labels[2] = bad
    with pytest.raises(ValueError, match=rf"labels holds {bad}, outside \[0, M\) = \[0, {M}\)"):
        call("info_nce", labels=labels)


@pytest.mark.parametrize("shape", [(B + 1,), (B - 1,), (1, B), ()],
                         ids=["longer", "shorter", "2d", "scalar"])
def test_labels_wrong_shape(shape):
    with pytest.raises(ValueError, match=rf"labels must have shape \(N,\) = \({B},\)"):
        call("info_nce", labels=torch.zeros(shape, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool],
                         ids=["float32", "float64", "bool"])
def test_labels_not_integers(dtype):
    with pytest.raises(TypeError, match="labels must hold integer key indices"):
        call("info_nce", labels=torch.zeros(B, dtype=dtype))


def test_labels_not_a_tensor():
    with pytest.raises(TypeError, match="labels must be a torch.Tensor or None"):
        call("info_nce", labels=list(range(B)))


def test_default_labels_need_enough_keys():
    """labels=None pairs query i with key i: fewer keys than queries is an error that says
    how to fix it; explicit labels into the few keys are fine."""
    with pytest.raises(ValueError, match="labels=None pairs query i with key i, which needs "
                       "M >= N"):
        call("info_nce", keys=features(B - 1))
    few = call("info_nce", keys=features(B - 1), labels=torch.arange(B) % (B - 1))
    assert torch.isfinite(few)


@pytest.mark.parametrize("rows", [1, 2 * B + 1])
def test_nt_xent_odd_row_count(rows):
    with pytest.raises(ValueError, match=rf"features must stack two views .*odd number of "
                       rf"rows, {rows}"):
        call("nt_xent", features=features(rows))


@pytest.mark.parametrize("rows", [B + 1, B + 2, B - 2])
def test_nt_xent_module_views_of_different_batch(rows):
    """NTXentLoss(z1, z2) pairs row i of z1 with row i of z2: views of different batch sizes
    are an error (stacked, B + (B + 2) rows would pass as views of B + 1 samples)."""
    with pytest.raises(ValueError, match=rf"features and second_view must have the same shape "
                       rf"\(B, D\).*got \({B}, {D}\) and \({rows}, {D}\)"):
        NTXentLoss(backend="torch")(features(B), features(rows))
    with pytest.raises(ValueError, match="second_view must be 2-D"):
        NTXentLoss(backend="torch")(features(B), features(B)[0])


# ---------------------------------------------------------------------------------------------
# options

REDUCTION_LOSSES = ["clip", "info_nce", "nt_xent"]


@pytest.mark.parametrize("loss", REDUCTION_LOSSES)
@pytest.mark.parametrize("reduction", ["avg", None, "Mean"], ids=["avg", "None", "Mean"])
def test_bad_reduction(loss, reduction):
    with pytest.raises(ValueError, match="reduction must be 'none', 'mean' or 'sum'"):
        call(loss, reduction=reduction)


@pytest.mark.parametrize("loss", ["clip", "siglip", "info_nce", "nt_xent"])
@pytest.mark.parametrize("backend", ["cuda", "Triton", None], ids=["cuda", "Triton", "None"])
def test_bad_backend(loss, backend):
    with pytest.raises(ValueError,
                       match="backend must be 'auto', 'triton', 'materialized' or 'torch'"):
        call(loss, backend=backend)


# filter_eps only matters to the Triton backend, but a bad value is a bug in the caller's code
# whichever backend runs it: it must not pass on a CPU and fail on a GPU.
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("loss", REDUCTION_LOSSES)
@pytest.mark.parametrize("filter_eps", ["bogus", -1e-3, float("nan")],
                         ids=["bogus", "negative", "nan"])
def test_bad_filter_eps(loss, backend, filter_eps):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = {"clip": ("image_features", "text_features"), "info_nce": ("query", "keys"),
             "nt_xent": ("features",)}[loss]
    rows = {"keys": M, "features": 2 * B}
    tensors = {n: features(rows.get(n, B)).to(device).requires_grad_() for n in names}
    with pytest.raises(ValueError, match="filter_eps must be 'auto', None or a float >= 0"):
        call(loss, filter_eps=filter_eps, backend=backend, **tensors)


def test_triton_on_cpu_without_interpreter_says_how_to_fix_it():
    """Without TRITON_INTERPRET, backend="triton" on CPU tensors fails clearly for every loss
    (in a fresh process: the variable must be unset before triton is imported), and "auto"
    falls back to the torch backend."""
    stdout = run_on_cpu_without_interpreter(
        """
        import torch
        import fusedloss
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        calls = {
            "clip": lambda backend: fusedloss.clip_loss(x, y, 10.0, backend=backend),
            "siglip": lambda backend: fusedloss.siglip_loss(x, y, 10.0, -10.0, backend=backend),
            "info_nce": lambda backend: fusedloss.info_nce_loss(x, y, backend=backend),
            "nt_xent": lambda backend: fusedloss.nt_xent_loss(x, backend=backend),
        }
        for name, fn in calls.items():
            try:
                fn("triton")
            except RuntimeError as error:
                print(name, "RuntimeError:", error)
            else:
                print(name, "no error")
            print(name, "auto:", fn("auto").item())
        """
    )
    lines = stdout.splitlines()
    for name in ("clip", "siglip", "info_nce", "nt_xent"):
        errors = [line for line in lines if line.startswith(f"{name} RuntimeError:")]
        assert len(errors) == 1, stdout
        assert "TRITON_INTERPRET=1" in errors[0] and "backend='torch'" in errors[0], errors[0]
        assert any(line.startswith(f"{name} auto:") for line in lines), stdout


# ---------------------------------------------------------------------------------------------
# modules: validated at construction


@pytest.mark.parametrize("module, kwargs, message", [
    pytest.param(ClipLoss, dict(world_size=2, local_loss=True), "gather_with_grad=False",
                 id="clip-local-loss-without-gather-grad"),
    pytest.param(ClipLoss, dict(world_size=2, reduction="sum"), "computes the mean",
                 id="clip-world-size-reduction"),
    pytest.param(ClipLoss, dict(use_horovod=True), "use_horovod=True", id="clip-horovod"),
    pytest.param(SigLipLoss, dict(world_size=2, dist_impl="ring"), "dist_impl",
                 id="siglip-dist-impl"),
    pytest.param(ClipLoss, dict(reduction="avg"), "reduction", id="clip-reduction"),
    pytest.param(ClipLoss, dict(filter_eps=-1.0), "filter_eps", id="clip-filter-eps"),
    pytest.param(InfoNCELoss, dict(temperature=0.0), "temperature must be > 0",
                 id="info_nce-temperature-0"),
    pytest.param(InfoNCELoss, dict(temperature=-0.1), "temperature must be > 0",
                 id="info_nce-temperature-negative"),
    pytest.param(InfoNCELoss, dict(reduction="avg"), "reduction", id="info_nce-reduction"),
    pytest.param(InfoNCELoss, dict(filter_eps="bogus"), "filter_eps",
                 id="info_nce-filter-eps"),
    pytest.param(NTXentLoss, dict(temperature=0.0), "temperature must be > 0",
                 id="nt_xent-temperature"),
    pytest.param(NTXentLoss, dict(reduction=None), "reduction", id="nt_xent-reduction"),
    pytest.param(NTXentLoss, dict(filter_eps=float("nan")), "filter_eps",
                 id="nt_xent-filter-eps"),
])
def test_module_rejects_bad_options(module, kwargs, message):
    with pytest.raises(ValueError, match=message):
        module(**kwargs)


def test_distributed_modules_need_a_process_group():
    """world_size > 1 runs on the ring (tests/test_distributed.py); without an initialized
    process group the call says so."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    x = features()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ClipLoss(world_size=2, rank=1, local_loss=True, gather_with_grad=True)(x, x, 10.0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        SigLipLoss(world_size=4)(x, x, 10.0, -10.0)


@pytest.mark.parametrize("module, args, message", [
    pytest.param(ClipLoss(backend="torch"), (features(), features(B + 1), 10.0),
                 "image_features and text_features", id="clip"),
    pytest.param(SigLipLoss(backend="torch"), (features(), features(), torch.ones(2), -10.0),
                 "logit_scale must be a scalar", id="siglip"),
    pytest.param(InfoNCELoss(backend="torch"), (features(), features(B - 1)), "labels=None",
                 id="info_nce"),
    pytest.param(NTXentLoss(backend="torch"), (features(2 * B + 1),), "odd number of rows",
                 id="nt_xent"),
])
def test_module_call_errors_name_the_argument(module, args, message):
    with pytest.raises(ValueError, match=message):
        module(*args)


def test_public_api():
    for name in ("clip_loss", "info_nce_loss", "nt_xent_loss", "siglip_loss", "ClipLoss",
                 "SigLipLoss", "InfoNCELoss", "NTXentLoss"):
        assert name in fusedloss.__all__ and hasattr(fusedloss, name), name


# ---------------------------------------------------------------------------------------------
# the distributed forms: the same rules on a ring of two gloo processes


def _error_of(fn, *args) -> str | None:
    try:
        fn(*args)
    except (TypeError, ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _ring_rules(rank, world):
    """Per (form, case): an error message, or (loss is NaN, scale grad is NaN, feature grads
    are NaN), or the loss; the same calls on every rank."""
    forms = {
        "clip": lambda a, s: fd.clip_loss(a, a, s),
        "siglip": lambda a, s: fd.siglip_loss(a, a, s, -10.0),
        "info_nce": lambda a, s: fd.info_nce_loss(a, a, temperature=s),
        "nt_xent": lambda a, s: fd.nt_xent_loss(a, s),
        "module-clip": lambda a, s: ClipLoss(local_loss=True, gather_with_grad=True, rank=rank,
                                             world_size=world)(a, a, s),
        "module-siglip": lambda a, s: SigLipLoss(rank=rank, world_size=world)(a, a, s, -10.0),
    }
    scale = {"info_nce": 0.1, "nt_xent": 0.5}
    out = {}
    for form, fn in forms.items():
        good = scale.get(form, 10.0)
        x = features(4, seed=rank)
        for value in NOT_POSITIVE_OR_NOT_FINITE:
            out[form, f"number {value!r}"] = _error_of(fn, x, value)
        for value in TENSOR_VALUES:
            scalar, a = torch.tensor(value, requires_grad=True), x.clone().requires_grad_()
            loss = fn(a, scalar)
            loss.backward()
            out[form, f"tensor {value!r}"] = (bool(loss.isnan()), bool(scalar.grad.isnan()),
                                             bool(a.grad.isnan().all()))
        out[form, "0 rows on rank 1"] = fn(x[:0] if rank == 1 else x, good).detach()
        out[form, "0 rows on every rank"] = _error_of(fn, x[:0], good)
        out[form, "D = 0"] = _error_of(fn, torch.zeros(4, 0), good)
    return out


def test_ring_scale_and_empty_rules(workers):
    results = workers(2).run(_ring_rules)
    for rank, out in enumerate(all_ok(results)):
        for (form, case), got in out.items():
            where = f"rank {rank}, {form}, {case}"
            name = "temperature" if form in ("info_nce", "nt_xent") else "logit_scale"
            if case.startswith("number"):
                value = float(case.split()[1].strip("'"))
                assert got is not None and got.startswith("ValueError"), (where, got)
                assert re.search(scale_error(name, value), got), (where, got)
            elif case.startswith("tensor"):
                assert got == (True, True, True), where
            elif case == "0 rows on rank 1":
                assert torch.isfinite(got), where
            elif case == "0 rows on every rank":
                assert got is not None and "ValueError: the global batch is empty" in got, where
            else:
                feature = "features" if form == "nt_xent" else (
                    "query" if form == "info_nce" else "image_features")
                assert got == f"ValueError: {feature} has width D = 0", (where, got)
    assert not any(isinstance(r, Raised) for r in results)
