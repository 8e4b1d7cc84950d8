"""The float64 references equal PyTorch / open_clip formulas written out independently.

Every other test trusts ``fusedloss.reference``; these tests are what that trust rests on.
Values and gradients are compared in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_to_ref, rel_err
from hypothesis import given
from hypothesis import strategies as st

from fusedloss.reference import (
    clip_loss_ref,
    info_nce_loss_ref,
    linear_cross_entropy_ref,
    nt_xent_loss_ref,
    siglip_loss_ref,
)

Tensors = dict[str, torch.Tensor | None]


def value_and_grads(
    fn: Callable[..., torch.Tensor],
    tensors: Tensors,
    *,
    upstream_seed: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Evaluate ``fn(**fresh float64 leaves)`` and return its value and input gradients.

    Non-scalar outputs are reduced against a fixed random upstream gradient, so that
    "none" reductions check their full Jacobian-vector product. ``None`` entries pass through.
    """
    leaves = {
        name: None if t is None else t.detach().double().clone().requires_grad_()
        for name, t in tensors.items()
    }
    out = fn(**leaves)
    if out.dim() == 0:
        upstream = torch.ones_like(out)
    else:
        generator = torch.Generator().manual_seed(upstream_seed)
        upstream = torch.randn(out.shape, generator=generator, dtype=out.dtype)
    out.backward(upstream)
    grads = {name: leaf.grad for name, leaf in leaves.items() if leaf is not None}
    return out.detach(), grads


def assert_same(ours: tuple, theirs: tuple) -> None:
    """Values and every gradient equal to float64 precision."""
    torch.testing.assert_close(ours[0], theirs[0])
    assert ours[1].keys() == theirs[1].keys()
    for name in ours[1]:
        torch.testing.assert_close(ours[1][name], theirs[1][name], msg=f"grad of {name}")


def make_lm_head(
    seed: int,
    leading: tuple[int, ...] = (3, 5),
    dim: int = 7,
    vocab: int = 11,
    *,
    ignore_index: int = -100,
    ignore_fraction: float = 0.3,
) -> dict[str, torch.Tensor]:
    """Random (input, linear_weight, linear_bias, class weight, target) for an LM head."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, leading, generator=g)
    ignored = torch.rand(leading, generator=g) < ignore_fraction
    target = torch.where(ignored, torch.full_like(target, ignore_index), target)
    return {
        "input": torch.randn(*leading, dim, generator=g, dtype=torch.float64),
        "linear_weight": torch.randn(vocab, dim, generator=g, dtype=torch.float64),
        "linear_bias": torch.randn(vocab, generator=g, dtype=torch.float64),
        "weight": torch.rand(vocab, generator=g, dtype=torch.float64) + 0.1,
        "target": target,
    }


def torch_linear_cross_entropy(
    input,
    linear_weight,
    linear_bias,
    target,
    *,
    weight,
    reduction,
    ignore_index,
    label_smoothing,
):
    """F.cross_entropy on float64 logits, leading dims flattened then restored."""
    logits = F.linear(input.double(), linear_weight.double(), linear_bias)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        weight=weight,
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss


# --------------------------------------------------------------------------------------------
# linear_cross_entropy_ref against F.cross_entropy: every option PyTorch supports
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2], ids=["ls0", "ls0.2"])
@pytest.mark.parametrize("ignore_index", [-100, 3], ids=["ignore-100", "ignore3"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("has_weight", [False, True], ids=["noweight", "weight"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
def test_linear_cross_entropy_matches_torch(
    has_bias, has_weight, reduction, ignore_index, label_smoothing
):
    data = make_lm_head(seed=1, ignore_index=ignore_index)
    weight = data["weight"] if has_weight else None
    target = data["target"]
    assert (target == ignore_index).any() and (target != ignore_index).any()
    tensors = {
        "input": data["input"],
        "linear_weight": data["linear_weight"],
        "linear_bias": data["linear_bias"] if has_bias else None,
    }
    options = dict(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing)
    ours = value_and_grads(
        lambda **t: linear_cross_entropy_ref(
            t["input"],
            t["linear_weight"],
            target,
            linear_bias=t["linear_bias"],
            weight=weight,
            **options,
        ),
        tensors,
    )
    theirs = value_and_grads(
        lambda **t: torch_linear_cross_entropy(**t, target=target, weight=weight, **options),
        tensors,
    )
    assert ours[0].dtype == torch.float64
    assert_same(ours, theirs)


@pytest.mark.skipif(
    not hasattr(F, "linear_cross_entropy"), reason="F.linear_cross_entropy needs torch >= 2.13"
)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_linear_cross_entropy_matches_torch_linear_cross_entropy(reduction):
    data = make_lm_head(seed=2, leading=(13,), ignore_index=-100)
    args = (data["input"], data["linear_weight"], data["target"])
    options = dict(
        linear_bias=data["linear_bias"],
        weight=data["weight"],
        reduction=reduction,
        label_smoothing=0.1,
    )
    torch.testing.assert_close(
        linear_cross_entropy_ref(*args, **options), F.linear_cross_entropy(*args, **options)
    )


@given(
    seed=st.integers(0, 2**31 - 1),
    leading=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    dim=st.integers(1, 9),
    vocab=st.integers(1, 17),
    ignore_fraction=st.sampled_from([0.0, 0.5, 0.9]),
    reduction=st.sampled_from(["none", "sum", "mean"]),
    label_smoothing=st.sampled_from([0.0, 0.05, 1.0]),
    has_weight=st.booleans(),
    has_bias=st.booleans(),
)
def test_linear_cross_entropy_property(
    seed, leading, dim, vocab, ignore_fraction, reduction, label_smoothing, has_weight, has_bias
):
    data = make_lm_head(seed, leading, dim, vocab, ignore_fraction=ignore_fraction)
    target = data["target"]
    weight = data["weight"] if has_weight else None
    bias = data["linear_bias"] if has_bias else None
    options = dict(reduction=reduction, label_smoothing=label_smoothing)

    per_token = linear_cross_entropy_ref(
        data["input"],
        data["linear_weight"],
        target,
        linear_bias=bias,
        weight=weight,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    ignored = target == -100
    assert per_token.shape == target.shape
    assert torch.isfinite(per_token).all()
    assert (per_token >= 0).all()  # every term is a non-negative weight times -log p
    assert (per_token[ignored] == 0).all()

    loss = linear_cross_entropy_ref(
        data["input"], data["linear_weight"], target, linear_bias=bias, weight=weight, **options
    )
    if ignored.all() and reduction == "mean":
        assert loss.item() == 0.0  # PyTorch would return NaN here
        return
    expected = torch_linear_cross_entropy(
        data["input"],
        data["linear_weight"],
        bias,
        target,
        weight=weight,
        ignore_index=-100,
        **options,
    )
    torch.testing.assert_close(loss, expected)


# --------------------------------------------------------------------------------------------
# linear_cross_entropy_ref: the extensions (softcap, z-loss, shift, return_lse, all ignored)
# --------------------------------------------------------------------------------------------


def logits_of(data: dict[str, torch.Tensor]) -> torch.Tensor:
    return data["input"] @ data["linear_weight"].T + data["linear_bias"]


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_softcap_caps_logits_before_cross_entropy(reduction):
    data = make_lm_head(seed=3)
    data["input"] = data["input"] * 4  # logits well beyond the cap, so the cap matters
    cap = 2.5
    target = data["target"]
    tensors = {k: data[k] for k in ("input", "linear_weight", "linear_bias")}
    ours = value_and_grads(
        lambda **t: linear_cross_entropy_ref(
            t["input"],
            t["linear_weight"],
            target,
            linear_bias=t["linear_bias"],
            softcap=cap,
            reduction=reduction,
            label_smoothing=0.1,
        ),
        tensors,
    )

    def by_hand(input, linear_weight, linear_bias):
        logits = cap * torch.tanh((input @ linear_weight.T + linear_bias) / cap)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            reduction=reduction,
            label_smoothing=0.1,
        )
        return loss.reshape(target.shape) if reduction == "none" else loss

    assert_same(ours, value_and_grads(by_hand, tensors))
    uncapped = linear_cross_entropy_ref(
        data["input"],
        data["linear_weight"],
        target,
        linear_bias=data["linear_bias"],
        reduction=reduction,
        label_smoothing=0.1,
    )
    assert not torch.allclose(ours[0], uncapped)  # the option is not ignored
    for no_cap in (None, 0.0):
        torch.testing.assert_close(
            linear_cross_entropy_ref(
                data["input"],
                data["linear_weight"],
                target,
                linear_bias=data["linear_bias"],
                softcap=no_cap,
                reduction=reduction,
                label_smoothing=0.1,
            ),
            uncapped,
        )


@pytest.mark.parametrize("has_weight", [False, True], ids=["noweight", "weight"])
def test_z_loss_adds_lse_squared_per_token(has_weight):
    data = make_lm_head(seed=4)
    target = data["target"]
    weight = data["weight"] if has_weight else None
    z = 1e-2
    not_ignored = target != -100
    lse = torch.logsumexp(logits_of(data), dim=-1)
    expected_extra = torch.where(not_ignored, z * lse**2, torch.zeros_like(lse))

    def loss(z_loss, reduction):
        return linear_cross_entropy_ref(
            data["input"],
            data["linear_weight"],
            target,
            linear_bias=data["linear_bias"],
            weight=weight,
            label_smoothing=0.1,
            z_loss=z_loss,
            reduction=reduction,
        )

    torch.testing.assert_close(loss(z, "none") - loss(0.0, "none"), expected_extra)
    torch.testing.assert_close(loss(z, "sum") - loss(0.0, "sum"), expected_extra.sum())
    # "mean": the z-loss shares the cross-entropy's denominator, Σ over non-ignored w[y].
    denominator = (weight[target[not_ignored]] if has_weight else not_ignored).sum()
    torch.testing.assert_close(
        loss(z, "mean") - loss(0.0, "mean"), expected_extra.sum() / denominator
    )

    # The z-loss is differentiable: d(λ·lse²)/d(input) = 2λ·lse·softmax(logits) @ W.
    def z_only(input):
        return linear_cross_entropy_ref(
            input,
            data["linear_weight"],
            target,
            linear_bias=data["linear_bias"],
            weight=weight,
            z_loss=z,
            reduction="sum",
        ) - linear_cross_entropy_ref(
            input,
            data["linear_weight"],
            target,
            linear_bias=data["linear_bias"],
            weight=weight,
            reduction="sum",
        )

    _, grads = value_and_grads(z_only, {"input": data["input"]})
    probs = torch.softmax(logits_of(data), dim=-1)
    expected_grad = (2 * z * lse * not_ignored).unsqueeze(-1) * (probs @ data["linear_weight"])
    torch.testing.assert_close(grads["input"], expected_grad)


def test_shift_predicts_the_next_token():
    data = make_lm_head(seed=5, leading=(2, 6))
    input, classifier, target = data["input"], data["linear_weight"], data["target"]
    shifted = linear_cross_entropy_ref(input, classifier, target, shift=True, reduction="none")
    assert shifted.shape == (2, 5)
    torch.testing.assert_close(
        shifted,
        linear_cross_entropy_ref(input[:, :-1], classifier, target[:, 1:], reduction="none"),
    )
    for b in range(2):
        for t in range(5):
            y = target[b, t + 1]
            expected = 0.0 if y == -100 else F.cross_entropy(input[b, t] @ classifier.T, y)
            torch.testing.assert_close(shifted[b, t], torch.as_tensor(expected).double())

    # The last position predicts nothing: its input gets no gradient.
    leaf = input.clone().requires_grad_()
    linear_cross_entropy_ref(leaf, classifier, target, shift=True).backward()
    assert (leaf.grad[:, -1] == 0).all() and leaf.grad[:, :-1].abs().sum() > 0


@pytest.mark.parametrize("shift", [False, True], ids=["noshift", "shift"])
def test_return_lse(shift):
    data = make_lm_head(seed=6)
    args = (data["input"], data["linear_weight"], data["target"])
    options = dict(linear_bias=data["linear_bias"], softcap=3.0, shift=shift, reduction="sum")
    loss, lse = linear_cross_entropy_ref(*args, **options, return_lse=True)
    torch.testing.assert_close(loss, linear_cross_entropy_ref(*args, **options))

    logits = 3.0 * torch.tanh(logits_of(data) / 3.0)
    target = data["target"]
    if shift:
        logits, target = logits[..., :-1, :], target[..., 1:]
    expected = torch.where(target != -100, torch.logsumexp(logits, -1), torch.zeros(()))
    assert lse.dtype == torch.float64 and lse.shape == target.shape
    torch.testing.assert_close(lse, expected)


def test_ignored_tokens_are_exactly_zero_with_every_option():
    data = make_lm_head(seed=7, ignore_fraction=0.5)
    input = data["input"].clone().requires_grad_()
    per_token = linear_cross_entropy_ref(
        input,
        data["linear_weight"],
        data["target"],
        linear_bias=data["linear_bias"],
        weight=data["weight"],
        label_smoothing=0.3,
        z_loss=1e-3,
        softcap=5.0,
        reduction="none",
    )
    ignored = data["target"] == -100
    assert (per_token[ignored] == 0).all() and (per_token[~ignored] > 0).all()
    per_token.sum().backward()
    assert (input.grad[ignored] == 0).all()


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_all_ignored_gives_zero_loss_and_zero_grads(reduction):
    data = make_lm_head(seed=8, ignore_fraction=1.0)
    assert (data["target"] == -100).all()
    tensors = {k: data[k] for k in ("input", "linear_weight", "linear_bias")}
    loss, grads = value_and_grads(
        lambda **t: linear_cross_entropy_ref(
            t["input"],
            t["linear_weight"],
            data["target"],
            linear_bias=t["linear_bias"],
            weight=data["weight"],
            label_smoothing=0.1,
            z_loss=1e-3,
            reduction=reduction,
        ),
        tensors,
    )
    assert (loss == 0).all()
    for name, grad in grads.items():
        assert (grad == 0).all(), name
    if reduction == "mean":  # the one documented departure from PyTorch
        assert torch_linear_cross_entropy(
            **tensors,
            target=data["target"],
            weight=None,
            reduction="mean",
            ignore_index=-100,
            label_smoothing=0.0,
        ).isnan()


def test_low_precision_inputs_are_upcast():
    data = make_lm_head(seed=9)
    input = data["input"].bfloat16().requires_grad_()
    classifier = data["linear_weight"].bfloat16().requires_grad_()
    loss = linear_cross_entropy_ref(input, classifier, data["target"])
    assert loss.dtype == torch.float64
    expected = linear_cross_entropy_ref(input.double(), classifier.double(), data["target"])
    torch.testing.assert_close(loss, expected)  # bf16 values, exact float64 arithmetic
    loss.backward()
    assert input.grad.dtype == torch.bfloat16 and classifier.grad.dtype == torch.bfloat16


def test_invalid_reduction_is_rejected():
    data = make_lm_head(seed=10)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy_ref(
            data["input"], data["linear_weight"], data["target"], reduction="avg"
        )
    with pytest.raises(ValueError, match="reduction"):
        clip_loss_ref(data["input"][0], data["input"][1], 1.0, reduction="batchmean")


# --------------------------------------------------------------------------------------------
# Contrastive losses
# --------------------------------------------------------------------------------------------


def features(seed: int, *shape: int, normalize: bool = True) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return F.normalize(x, dim=-1) if normalize else x


def open_clip_loss(image_features, text_features, logit_scale, logit_bias=None, reduction="mean"):
    """open_clip ClipLoss.forward on one process (world_size=1), written out."""
    logits_per_image = logit_scale * image_features @ text_features.T
    logits_per_text = logit_scale * text_features @ image_features.T
    if logit_bias is not None:
        logits_per_image = logits_per_image + logit_bias
        logits_per_text = logits_per_text + logit_bias
    labels = torch.arange(image_features.shape[0])
    return (
        F.cross_entropy(logits_per_image, labels, reduction=reduction)
        + F.cross_entropy(logits_per_text, labels, reduction=reduction)
    ) / 2


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
def test_clip_matches_open_clip(has_bias, reduction):
    tensors = {
        "image_features": features(11, 6, 5),
        "text_features": features(12, 6, 5),
        "logit_scale": torch.tensor(math.log(1 / 0.07)).exp(),
        "logit_bias": torch.tensor(-1.5) if has_bias else None,
    }
    ours = value_and_grads(lambda **t: clip_loss_ref(**t, reduction=reduction), tensors)
    theirs = value_and_grads(lambda **t: open_clip_loss(**t, reduction=reduction), tensors)
    assert ours[0].shape == ((6,) if reduction == "none" else ())
    assert_same(ours, theirs)


def test_clip_accepts_python_scalars():
    image, text = features(13, 4, 3), features(14, 4, 3)
    torch.testing.assert_close(
        clip_loss_ref(image, text, 10.0, -2.0),
        clip_loss_ref(image, text, torch.tensor(10.0), torch.tensor(-2.0)),
    )


@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 9),
    dim=st.integers(1, 8),
    logit_scale=st.floats(0.5, 100.0),
    normalize=st.booleans(),
)
def test_clip_property(seed, batch, dim, logit_scale, normalize):
    image = features(seed, batch, dim, normalize=normalize)
    text = features(seed + 1, batch, dim, normalize=normalize)
    per_pair = clip_loss_ref(image, text, logit_scale, reduction="none")
    assert per_pair.shape == (batch,) and torch.isfinite(per_pair).all()
    assert (per_pair >= 0).all()
    torch.testing.assert_close(per_pair.mean(), open_clip_loss(image, text, logit_scale))
    # Symmetric: swapping the modalities changes nothing.
    torch.testing.assert_close(clip_loss_ref(text, image, logit_scale, reduction="none"), per_pair)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("custom_labels", [False, True], ids=["arange", "labels"])
def test_info_nce_matches_cross_entropy(custom_labels, reduction):
    query, keys = features(15, 5, 4), features(16, 9, 4)  # M > N: extra negatives
    labels = torch.tensor([8, 0, 3, 3, 6]) if custom_labels else None
    temperature = 0.1
    ours = value_and_grads(
        lambda **t: info_nce_loss_ref(
            **t, labels=labels, temperature=temperature, reduction=reduction
        ),
        {"query": query, "keys": keys},
    )
    targets = labels if custom_labels else torch.arange(5)
    theirs = value_and_grads(
        lambda query, keys: F.cross_entropy(
            query @ keys.T / temperature, targets, reduction=reduction
        ),
        {"query": query, "keys": keys},
    )
    assert_same(ours, theirs)


def nt_xent_loop(features: torch.Tensor, temperature: float) -> torch.Tensor:
    """NT-Xent as in the SimCLR paper: -log(exp(s_ip/τ) / Σ_{k≠i} exp(s_ik/τ)), row by row."""
    rows = features.shape[0]
    half = rows // 2
    losses = []
    for i in range(rows):
        positive = i + half if i < half else i - half
        numerator = torch.exp(features[i] @ features[positive] / temperature)
        denominator = sum(
            torch.exp(features[i] @ features[k] / temperature) for k in range(rows) if k != i
        )
        losses.append(-torch.log(numerator / denominator))
    return torch.stack(losses)


@pytest.mark.parametrize("temperature", [0.1, 0.5])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_nt_xent_matches_loop(reduction, temperature):
    tensors = {"features": features(17, 8, 6)}
    ours = value_and_grads(
        lambda features: nt_xent_loss_ref(features, temperature, reduction=reduction), tensors
    )
    reducers = {"none": lambda x: x, "sum": torch.sum, "mean": torch.mean}
    theirs = value_and_grads(
        lambda features: reducers[reduction](nt_xent_loop(features, temperature)), tensors
    )
    assert_same(ours, theirs)


def test_nt_xent_rejects_odd_batch():
    with pytest.raises(ValueError, match="two views"):
        nt_xent_loss_ref(features(18, 5, 3))


def siglip_loop(image_features, text_features, logit_scale, logit_bias):
    """open_clip SigLipLoss on one process, one pair at a time: -Σ log σ(z·x) / b."""
    batch = image_features.shape[0]
    total = 0.0
    for i in range(batch):
        for j in range(batch):
            z = 1.0 if i == j else -1.0
            logit = logit_scale * (image_features[i] @ text_features[j]) + logit_bias
            total = total - torch.log(1.0 / (1.0 + torch.exp(-z * logit)))
    return total / batch


def test_siglip_matches_loop():
    tensors = {
        "image_features": features(19, 5, 4),
        "text_features": features(20, 5, 4),
        "logit_scale": torch.tensor(10.0),
        "logit_bias": torch.tensor(-10.0),
    }
    ours = value_and_grads(siglip_loss_ref, tensors)
    assert ours[0].shape == ()
    assert_same(ours, value_and_grads(siglip_loop, tensors))


# --------------------------------------------------------------------------------------------
# tests/helpers.py
# --------------------------------------------------------------------------------------------


def test_rel_err():
    ref = torch.tensor([3.0, 4.0])
    assert rel_err(ref, ref) == 0.0
    assert rel_err(torch.zeros(2), torch.zeros(2)) == 0.0
    assert rel_err(torch.ones(2), torch.zeros(2)) == math.inf
    assert rel_err(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert math.isnan(rel_err(torch.tensor([math.nan, 4.0]), ref))


def test_assert_close_to_ref():
    ref = torch.linspace(1, 2, 64, dtype=torch.float64)
    torch_bf16 = ref.bfloat16()
    assert_close_to_ref(torch_bf16, torch_bf16, ref)  # as good as torch
    with pytest.raises(AssertionError, match="exceeds bound"):
        assert_close_to_ref((ref * 1.01).bfloat16(), torch_bf16, ref)
    with pytest.raises(AssertionError):
        assert_close_to_ref(torch.full_like(torch_bf16, math.nan), torch_bf16, ref)
    # a subnormal reference: zero (a flushed result) passes, a normal-sized error does not
    tiny_ref = torch.tensor(3.4e-42, dtype=torch.float64)
    assert_close_to_ref(torch.tensor(0.0), torch.tensor(3.4e-42), tiny_ref)
    with pytest.raises(AssertionError, match="subnormal"):
        assert_close_to_ref(torch.tensor(1e-30), torch.tensor(3.4e-42), tiny_ref)
    with pytest.raises(AssertionError, match="subnormal"):
        assert_close_to_ref(torch.tensor(math.nan), torch.tensor(3.4e-42), tiny_ref)
