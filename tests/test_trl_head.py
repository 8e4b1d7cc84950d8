"""TRL's trainers on fusedloss's LM head (``fusedloss.integrations.trl``, trl 1.16).

TRL's trainers compute every loss through its own fused head function; the integration swaps
that function for fusedloss's. Checked here: the function against TRL's own (every output, the
gradients, softcap, logit scale, temperature, autocast, an empty batch), then DPO and GRPO
training on a tiny random model on the CPU, with fusedloss's head against TRL's: the same
losses and parameters after a few steps.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_transformers import make_model  # noqa: E402
from test_transformers_trl import assert_params_equal, make_tokenizer  # noqa: E402
from trl.kernels import ChunkedLogProbFunction as TRLFunction  # noqa: E402

from fusedloss.integrations import trl as integration  # noqa: E402

ALL = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.fixture
def fusedloss_head():
    """TRL's head replaced by fusedloss's for the test."""
    integration.apply_fusedloss_to_trl()
    yield
    integration.remove_fusedloss_from_trl()


def _head_inputs(seed=0, n=23, v=301, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(v, d, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_()
    return h, w, b, torch.randint(0, v, (n,), generator=g)


@pytest.mark.parametrize("options", [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=0.9, final_logit_softcapping=5.0, logit_scale=0.5),
], ids=["plain", "temperature", "softcap-scale"])
def test_function_matches_trls(options):
    h, w, b, y = _head_inputs()
    args = (options["temperature"], 64, options.get("final_logit_softcapping"),
            options.get("logit_scale", 1.0), ALL)
    theirs = TRLFunction.apply(h, w, b, y, *args)
    ours = integration.LogProbFunction.apply(h, w, b, y, *args)
    for name, t, o in zip(ALL, theirs, ours, strict=True):
        if name == "is_top1":
            assert torch.equal(t, o)
        else:
            assert o.dtype == torch.float32
            torch.testing.assert_close(o, t, rtol=2e-6, atol=5e-6, msg=name)
    gen = torch.Generator().manual_seed(1)
    g, k = torch.randn(23, generator=gen), torch.randn(23, generator=gen)
    want = torch.autograd.grad((theirs[0] * g).sum() + (theirs[1] * k).sum(), (h, w, b))
    got = torch.autograd.grad((ours[0] * g).sum() + (ours[1] * k).sum(), (h, w, b))
    for name, x, r in zip(("d hidden", "d weight", "d bias"), got, want, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-5, msg=name)


def test_function_returns_only_what_is_asked():
    h, w, b, y = _head_inputs()
    out = integration.LogProbFunction.apply(h, w, None, y, 1.0, 64, None, 1.0,
                                            ("log_probs", "mean_logits"))
    assert out[0] is not None and out[3] is not None
    assert out[1] is None and out[2] is None and out[4] is None
    with pytest.raises(ValueError, match="outputs"):
        integration.LogProbFunction.apply(h, w, b, y, 1.0, 64, None, 1.0, ("logits",))


def test_function_on_an_empty_batch_and_fp32_head_cast():
    h, w, b, y = _head_inputs()
    logp, ent, *_ = integration.LogProbFunction.apply(h[:0], w, b, y[:0], 1.0, 64, None, 1.0,
                                                      ALL)
    assert logp.shape == ent.shape == (0,)
    logp.sum().backward()  # stays in the graph
    assert w.grad is not None and not w.grad.any()
    # cast_lm_head_to_fp32: fp32 hidden states with a bf16 head, autocast off
    ours = integration.LogProbFunction.apply(h.detach(), w.detach().bfloat16(), None, y, 1.0,
                                             64, None, 1.0, ("log_probs",))
    theirs = TRLFunction.apply(h.detach(), w.detach().bfloat16(), None, y, 1.0, 64, None,
                               1.0, ("log_probs",))
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)


def test_apply_and_remove():
    from trl.trainer import utils

    original = utils._ChunkedLogProbFunction
    integration.apply_fusedloss_to_trl()
    integration.apply_fusedloss_to_trl()  # idempotent
    assert utils._ChunkedLogProbFunction is integration.LogProbFunction
    assert integration.is_fusedloss_applied_to_trl()
    integration.remove_fusedloss_from_trl()
    assert utils._ChunkedLogProbFunction is original
    assert not integration.is_fusedloss_applied_to_trl()


# ------------------------------------------------------------------------------------------
# trainers on a tiny model


PREFERENCES = {
    "prompt": ["the cat", "a dog", "the big red", "it was"],
    "chosen": [" sat on the mat", " ran fast", " bird flew under the tree", " very fast"],
    "rejected": [" ran", " sat on a log and then it was slow", " dog", " red"],
}


def _config(cls, tmp_path, **extra):
    return cls(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
               learning_rate=0.02, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
               max_grad_norm=0.0, use_cpu=True, bf16=False, gradient_checkpointing=False,
               report_to=[], save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
               dataloader_num_workers=0, **extra)


def _dpo(model, tmp_path, **extra):
    """Two DPO steps; (model, logged losses)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model),
                                 args=_config(trl.DPOConfig, tmp_path, **extra),
                                 train_dataset=datasets.Dataset.from_dict(PREFERENCES),
                                 processing_class=make_tokenizer())
        trainer.train()
    return trainer.model, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("extra", [{}, dict(loss_type=["ipo"]), dict(use_weighting=True)],
                         ids=["sigmoid", "ipo", "weighting"])
def test_dpo_trainer_trains_alike(extra, tmp_path):
    base = make_model()
    start = {k: v.clone() for k, v in base.named_parameters()}
    ref, ref_losses = _dpo(copy.deepcopy(base), tmp_path, **extra)
    integration.apply_fusedloss_to_trl()
    try:
        ours, losses = _dpo(copy.deepcopy(base), tmp_path, **extra)
    finally:
        integration.remove_fusedloss_from_trl()
    assert len(losses) == 2
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_params_equal(ours, ref, start, rtol=1e-4, atol=1e-5)


def test_dpo_trainer_calls_fusedloss(tmp_path, fusedloss_head, monkeypatch):
    calls = []
    real = integration.ops.linear_log_probs

    def spy(*args):
        calls.append(args[8:11])  # entropy, square sum, logit sum asked for
        return real(*args)

    monkeypatch.setattr(integration.ops, "linear_log_probs", spy)
    _dpo(make_model(), tmp_path)
    assert calls and any(asked[0] and asked[2] for asked in calls)  # entropy, mean logits


def _grpo(model, tmp_path, **extra):
    """Two GRPO steps (sampled completions, a length reward); (model, logged losses)."""
    def reward(completions, **_):
        return [float(len(c)) for c in completions]

    config = _config(trl.GRPOConfig, tmp_path, num_generations=2, max_completion_length=5,
                     temperature=0.8, beta=0.04, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=config,
                                  train_dataset=datasets.Dataset.from_dict(
                                      {"prompt": PREFERENCES["prompt"]}),
                                  processing_class=make_tokenizer())
        trainer.train()
    return trainer.model, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("loss_type", ["grpo", pytest.param("dapo", marks=pytest.mark.slow)])
def test_grpo_trainer_trains_alike(loss_type, tmp_path, monkeypatch):
    base = make_model()
    # The KL term's reference model: a copy of the initial model (TRL loads it by name).
    monkeypatch.setattr(trl.trainer.grpo_trainer, "create_model_from_path",
                        lambda *args, **kwargs: copy.deepcopy(base))
    start = {k: v.clone() for k, v in base.named_parameters()}
    ref, ref_losses = _grpo(copy.deepcopy(base), tmp_path, loss_type=loss_type)
    integration.apply_fusedloss_to_trl()
    try:
        ours, losses = _grpo(copy.deepcopy(base), tmp_path, loss_type=loss_type)
    finally:
        integration.remove_fusedloss_from_trl()
    assert len(losses) == 2
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_params_equal(ours, ref, start, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # ~20 s of compiling: make test-slow
def test_function_compiles_with_fullgraph():
    """TRL may compile the model around its head: the function traces without a break."""
    torch._dynamo.reset()
    h, w, b, y = _head_inputs()

    def head(h, w):
        out = integration.LogProbFunction.apply(h, w, b, y, 0.7, 64, 5.0, 0.5, ALL)
        return out[0].sum() + out[1].sum()

    compiled = torch.compile(head, fullgraph=True, backend="aot_eager")
    got, want = compiled(h, w), head(h, w)
    torch.testing.assert_close(got, want)
    for x, r in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w)),
                    strict=True):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-5)
