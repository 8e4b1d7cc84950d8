"""``fusedloss.post_training``: GRPO and DPO losses against TRL 1.16's own code.

GRPO: ``GRPOTrainer._compute_loss`` itself, run on a stand-in trainer whose per-token
log-probabilities come from materialized logits, against ``grpo_loss`` on the same hidden
states and head (values and gradients), for each loss type and option. DPO: a real
``DPOTrainer`` on a tiny model computes the loss of a batch; ``dpo_loss`` on the model's hidden
states and head gives the same value and gradients.
"""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import fusedloss
from fusedloss import post_training

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")  # TRL's trainers import it

B, T, D, V = 4, 6, 16, 50


def _grpo_inputs(seed=0, per_token_advantages=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(V, D, generator=g, dtype=torch.float64) / 3).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    mask[:, 0] = 1
    shape = (B, T) if per_token_advantages else (B,)
    advantages = torch.randn(shape, generator=g, dtype=torch.float64)
    old = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 3.5
    ref = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 3.5
    return hidden, weight, ids, mask, advantages, old, ref


def _materialized_log_probs(hidden, weight, ids, temperature, bias=None, softcap=None):
    z = hidden @ weight.T + (0.0 if bias is None else bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    logp = logp_all.gather(-1, ids[..., None])[..., 0]
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _trl_grpo_loss(hidden, weight, ids, mask, advantages, old, ref, *, loss_type, beta,
                   epsilon=0.2, epsilon_high=None, delta=None, level="token",
                   bias_correction=True, temperature=1.0, max_completion_length=T,
                   num_items=None, bias=None, softcap=None):
    """GRPOTrainer._compute_loss on a stand-in trainer (one process, no accumulation)."""
    accelerator = SimpleNamespace(gather=lambda x: x.reshape(-1), num_processes=1,
                                  reduce=lambda x, reduction: x, sync_gradients=True,
                                  gather_for_metrics=lambda x: x)
    fake = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type,
        epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        args=SimpleNamespace(use_bias_correction_kl=bias_correction, delta=delta,
                             steps_per_generation=1),
        use_vllm=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, accelerator=accelerator,
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (
            *_materialized_log_probs(hidden, weight, ids, temperature, bias, softcap), None),
    )
    inputs = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long),
                  prompt_mask=torch.ones(B, 1, dtype=torch.long), completion_ids=ids,
                  completion_mask=mask, advantages=advantages,
                  num_items_in_batch=torch.tensor(float(mask.sum()) if num_items is None
                                                  else num_items))
    if old is not None:
        inputs["old_per_token_logps"] = old
    if beta:
        inputs["ref_per_token_logps"] = ref
    return trl.GRPOTrainer._compute_loss(fake, None, inputs)


GRPO_CASES = {
    "dapo": dict(loss_type="dapo", beta=0.0),
    "dapo-kl": dict(loss_type="dapo", beta=0.04),
    "grpo-kl-no-correction": dict(loss_type="grpo", beta=0.1, bias_correction=False),
    "bnpo-asymmetric": dict(loss_type="bnpo", beta=0.0, epsilon_high=0.28),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.04, max_completion_length=10),
    "grpo-sequence": dict(loss_type="grpo", beta=0.0, level="sequence"),
    "dapo-delta-temperature": dict(loss_type="dapo", beta=0.0, delta=1.5, temperature=0.7),
    "dapo-num-items": dict(loss_type="dapo", beta=0.0, num_items=40.0),
    "grpo-on-policy": dict(loss_type="grpo", beta=0.04, old=None),
    "grpo-token-advantages": dict(loss_type="grpo", beta=0.0, per_token=True),
    "grpo-epsilon-head-options": dict(loss_type="grpo", beta=0.04, epsilon=0.05,
                                      temperature=0.8, softcap=2.0, head_bias=True),
}


@pytest.mark.parametrize("case", GRPO_CASES, ids=list(GRPO_CASES))
def test_grpo_loss_equals_trls(case):
    kw = dict(GRPO_CASES[case])
    hidden, weight, ids, mask, advantages, old, ref = _grpo_inputs(
        per_token_advantages=kw.pop("per_token", False))
    if "old" in kw:
        old = kw.pop("old")
    bias = (torch.randn(V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
            if kw.pop("head_bias", False) else None)
    want = _trl_grpo_loss(hidden, weight, ids, mask, advantages, old, ref, bias=bias, **kw)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got = post_training.grpo_loss(
        hidden, weight, ids, mask, advantages, old_log_probs=old, ref_log_probs=ref,
        linear_bias=bias, softcap=kw.get("softcap"), epsilon=kw.get("epsilon", 0.2),
        beta=kw["beta"], epsilon_high=kw.get("epsilon_high"), delta=kw.get("delta"),
        loss_type=kw["loss_type"], importance_sampling_level=kw.get("level", "token"),
        kl_bias_correction=kw.get("bias_correction", True),
        temperature=kw.get("temperature", 1.0),
        max_completion_length=kw.get("max_completion_length"),
        num_items_in_batch=kw.get("num_items"))
    got_grads = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-9, atol=1e-12)
    for x, r in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(x, r, rtol=1e-9, atol=1e-12)


def test_grpo_loss_refuses_bad_options():
    hidden, weight, ids, mask, advantages, old, ref = _grpo_inputs()
    with pytest.raises(ValueError, match="loss_type"):
        post_training.grpo_loss(hidden, weight, ids, mask, advantages, loss_type="ppo")
    with pytest.raises(ValueError, match="ref_log_probs"):
        post_training.grpo_loss(hidden, weight, ids, mask, advantages, beta=0.1)
    with pytest.raises(ValueError, match="sequence"):
        post_training.grpo_loss(hidden, weight, ids, mask, advantages,
                                importance_sampling_level="sequence", loss_type="dapo")
    with pytest.raises(ValueError, match="completion_mask"):
        post_training.grpo_loss(hidden, weight, ids, mask[:, :3], advantages)


# ------------------------------------------------------------------------------------------
# DPO against a real DPOTrainer


@pytest.mark.parametrize("loss_type, extra", [
    ("sigmoid", {}), ("hinge", {}), ("ipo", {}), ("robust", dict(label_smoothing=0.2))])
def test_dpo_loss_equals_dpo_trainers(loss_type, extra, tmp_path):
    datasets = pytest.importorskip("datasets")
    from test_transformers import make_model
    from test_trl_head import PREFERENCES, _config, make_tokenizer

    model = make_model()
    ref_model = copy.deepcopy(model)
    with torch.no_grad():  # a reference that differs from the policy
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    config = _config(trl.DPOConfig, tmp_path, loss_type=[loss_type], beta=0.3, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.DPOTrainer(model=model, ref_model=ref_model, args=config,
                                 train_dataset=datasets.Dataset.from_dict(PREFERENCES),
                                 processing_class=make_tokenizer())
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    model.train()
    want = trainer.compute_loss(trainer.model, batch)
    want_grad = torch.autograd.grad(want, model.lm_head.weight)[0]

    ids, attention = batch["input_ids"], batch["attention_mask"]
    target = ids.masked_fill(batch["completion_mask"] == 0, -100)
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    with torch.no_grad():
        ref_hidden = ref_model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    got = post_training.dpo_loss(hidden, model.lm_head.weight, target, ref_input=ref_hidden,
                                 ref_weight=ref_model.lm_head.weight, beta=0.3,
                                 loss_type=loss_type, shift=True, **extra)
    got_grad = torch.autograd.grad(got, model.lm_head.weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)


def test_dpo_loss_applies_the_heads_options():
    """linear_bias, ref_bias and softcap reach both heads: DPO's Δ from the float64 reference
    log-probs formed with them."""
    from fusedloss.reference import linear_log_probs_ref

    g = torch.Generator().manual_seed(5)
    hidden, ref_hidden = (torch.randn(4, 5, D, generator=g, dtype=torch.float64)
                          for _ in range(2))
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    bias, ref_bias = (torch.randn(V, generator=g, dtype=torch.float64) for _ in range(2))
    target = torch.randint(0, V, (4, 5), generator=g)
    target[:, 0] = -100
    got = post_training.dpo_loss(hidden, weight, target, ref_input=ref_hidden, ref_weight=weight,
                                 linear_bias=bias, ref_bias=ref_bias, softcap=3.0, beta=0.5)
    policy = linear_log_probs_ref(hidden, weight, target, linear_bias=bias, softcap=3.0)[0]
    reference = linear_log_probs_ref(ref_hidden, weight, target, linear_bias=ref_bias,
                                     softcap=3.0)[0]
    ratios = (policy - reference).sum(-1)
    want = -torch.nn.functional.logsigmoid(0.5 * (ratios[:2] - ratios[2:])).mean()
    torch.testing.assert_close(got, want)


def test_dpo_loss_takes_precomputed_reference_log_probs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 5, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (4, 5), generator=g)
    ref_hidden = hidden + 0.1 * torch.randn(4, 5, D, generator=g, dtype=torch.float64)
    ref_logps = torch.log_softmax(ref_hidden @ weight.T, -1).gather(
        -1, target[..., None])[..., 0].sum(-1)
    a = post_training.dpo_loss(hidden, weight, target, ref_log_probs=ref_logps)
    b = post_training.dpo_loss(hidden, weight, target, ref_input=ref_hidden, ref_weight=weight)
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="exactly one"):
        post_training.dpo_loss(hidden, weight, target)
    with pytest.raises(ValueError, match="loss_type"):
        post_training.dpo_loss(hidden, weight, target, ref_log_probs=ref_logps, loss_type="kto")
    with pytest.raises(ValueError, match=r"\(2B, T, D\)"):
        post_training.dpo_loss(hidden[:3], weight, target[:3], ref_log_probs=ref_logps[:3])


# ------------------------------------------------------------------------------------------
# ORPO and CPO (SimPO) against TRL's own methods, KTO against a real KTOTrainer


def _pairs(seed=0):
    """(hidden (2B, T, D), head, completion labels (2B, T), NLL labels (B, T)): float64."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2 * B, T, D, generator=g, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(V, D, generator=g, dtype=torch.float64) / 2).requires_grad_()
    ids = torch.randint(0, V, (2 * B, T), generator=g)
    prompt = torch.arange(T)[None, :] < torch.randint(1, 3, (2 * B, 1), generator=g)
    pad = torch.arange(T)[None, :] >= T - torch.randint(0, 2, (2 * B, 1), generator=g)
    labels = ids.masked_fill(prompt | pad, -100)
    return hidden, weight, labels, ids[:B].masked_fill(pad[:B], -100)


def _trl_batch_log_probs(trainer_cls, hidden, weight, labels, average):
    return trainer_cls.get_batch_logps(hidden @ weight.T, labels, average_log_prob=average)


def _nll(hidden, weight, nll_labels):
    logits = (hidden[:B] @ weight.T)[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), nll_labels[:, 1:].reshape(-1))


def _assert_same(got, want, leaves, rtol=1e-8):
    """float64: the same up to the rounding of sums taken in another order."""
    torch.testing.assert_close(got, want.to(got.dtype), rtol=rtol, atol=1e-12)
    for x, r in zip(torch.autograd.grad(got, leaves, retain_graph=True),
                    torch.autograd.grad(want, leaves), strict=True):
        torch.testing.assert_close(x, r, rtol=rtol, atol=rtol * float(r.abs().max()))


def test_orpo_loss_equals_trls():
    from trl.experimental.orpo import ORPOTrainer

    hidden, weight, labels, nll_labels = _pairs()
    logps = _trl_batch_log_probs(ORPOTrainer, hidden, weight, labels, True)
    fake = SimpleNamespace(beta=0.3, accelerator=SimpleNamespace(device="cpu"))
    losses = ORPOTrainer.odds_ratio_loss(fake, logps[:B], logps[B:])[0]
    want = _nll(hidden, weight, nll_labels) - losses.mean()
    got = post_training.orpo_loss(hidden, weight, labels, nll_target=nll_labels, beta=0.3,
                                  shift=True)
    _assert_same(got, want, (hidden, weight), rtol=1e-6)  # TRL forms the odds ratio in fp32


@pytest.mark.parametrize("loss_type, extra", [
    ("sigmoid", dict(label_smoothing=0.1)), ("hinge", {}), ("ipo", {}),
    ("simpo", dict(simpo_gamma=0.7, cpo_alpha=0.0)), ("simpo", dict(cpo_alpha=0.5))])
def test_cpo_loss_equals_trls(loss_type, extra):
    from trl.experimental.cpo import CPOTrainer

    hidden, weight, labels, nll_labels = _pairs(1)
    options = dict(dict(label_smoothing=0.0, simpo_gamma=0.5, cpo_alpha=1.0), **extra)
    logps = _trl_batch_log_probs(CPOTrainer, hidden, weight, labels,
                                 loss_type in ("ipo", "simpo"))
    fake = SimpleNamespace(beta=0.4, alpha=0.0, loss_type=loss_type,
                           simpo_gamma=options["simpo_gamma"],
                           label_smoothing=options["label_smoothing"],
                           accelerator=SimpleNamespace(device="cpu"))
    want = CPOTrainer.cpo_loss(fake, logps[:B], logps[B:])[0].mean()
    if options["cpo_alpha"]:
        want = want + options["cpo_alpha"] * _nll(hidden, weight, nll_labels)
    got = post_training.cpo_loss(hidden, weight, labels, beta=0.4, loss_type=loss_type,
                                 nll_target=nll_labels, shift=True, **options)
    _assert_same(got, want, (hidden, weight))
    if loss_type == "simpo" and not options["cpo_alpha"]:
        simpo = post_training.simpo_loss(hidden, weight, labels, beta=0.4,
                                         gamma=options["simpo_gamma"], shift=True)
        torch.testing.assert_close(simpo, got)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_loss_equals_kto_trainers(loss_type, tmp_path):
    datasets = pytest.importorskip("datasets")
    from test_transformers import make_model
    from test_trl_head import PREFERENCES, _config, make_tokenizer

    model = make_model()
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    data = {"prompt": PREFERENCES["prompt"], "completion": PREFERENCES["chosen"],
            "label": [True, False, True, False]}
    config = _config(trl.KTOConfig, tmp_path, loss_type=loss_type, beta=0.3,
                     desirable_weight=1.2, undesirable_weight=0.8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.KTOTrainer(model=model, ref_model=ref_model, args=config,
                                 train_dataset=datasets.Dataset.from_dict(data),
                                 processing_class=make_tokenizer())
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    model.train()
    want = trainer.compute_loss(trainer.model, batch)
    want_grad = torch.autograd.grad(want, model.lm_head.weight)[0]

    def hidden_of(m, ids, mask):
        return m.model(input_ids=ids, attention_mask=mask).last_hidden_state

    def labels_of(ids, completion):
        return ids.masked_fill(completion == 0, -100)

    ids, attention = batch["input_ids"], batch["attention_mask"]
    target = labels_of(ids, batch["completion_mask"])
    kl = 0.0
    if trainer.calculate_KL:
        kl_ids, kl_attention = batch["KL_input_ids"], batch["KL_attention_mask"]
        kl_target = labels_of(kl_ids, batch["KL_completion_mask"])
        with torch.no_grad():
            kl_logps = [fusedloss.linear_log_probs(
                hidden_of(m, kl_ids, kl_attention), m.lm_head.weight, kl_target,
                shift=True).sum(-1) for m in (model, ref_model)]
        kl = (kl_logps[0] - kl_logps[1]).mean().clamp(min=0)
    with torch.no_grad():
        ref_hidden = hidden_of(ref_model, ids, attention)
    got = post_training.kto_loss(
        hidden_of(model, ids, attention), model.lm_head.weight, target, batch["label"].bool(),
        ref_input=ref_hidden, ref_weight=ref_model.lm_head.weight, kl=kl, beta=0.3,
        desirable_weight=1.2, undesirable_weight=0.8, loss_type=loss_type, shift=True)
    got_grad = torch.autograd.grad(got, model.lm_head.weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------
# every loss under torch.compile(fullgraph=True)


def _compile_cases():
    hidden, weight, labels, nll_labels = _pairs(2)
    hidden, weight = hidden.float().detach(), weight.float().detach()
    ref = torch.randn(2 * B, dtype=torch.float32) - 20
    g_h, g_w, g_ids, g_mask, g_adv, g_old, g_ref = _grpo_inputs(3)
    g_h, g_w, g_old, g_ref, g_adv = (t.float().detach() for t in (g_h, g_w, g_old, g_ref, g_adv))
    pairs = dict(target=labels, shift=True)
    return {
        "grpo": (lambda h, w: post_training.grpo_loss(
            h, w, g_ids, g_mask, g_adv, old_log_probs=g_old, ref_log_probs=g_ref, beta=0.04,
            loss_type="grpo", temperature=0.7), g_h, g_w),
        "dpo": (lambda h, w: post_training.dpo_loss(h, w, ref_log_probs=ref, **pairs),
                hidden, weight),
        "kto": (lambda h, w: post_training.kto_loss(
            h, w, labels, torch.arange(2 * B) % 2 == 0, ref_log_probs=ref, kl=0.1, shift=True),
            hidden, weight),
        "orpo": (lambda h, w: post_training.orpo_loss(h, w, nll_target=nll_labels, **pairs),
                 hidden, weight),
        "cpo": (lambda h, w: post_training.cpo_loss(h, w, loss_type="ipo", **pairs),
                hidden, weight),
        "simpo": (lambda h, w: post_training.simpo_loss(h, w, **pairs), hidden, weight),
    }


@pytest.mark.parametrize("name", ["grpo", "dpo", "kto", "orpo", "cpo", "simpo"])
def test_losses_compile_with_fullgraph(name):
    torch._dynamo.reset()
    fn, hidden, weight = _compile_cases()[name]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    got, want = compiled(*leaves), fn(*leaves)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for x, r in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves),
                    strict=True):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-6)
