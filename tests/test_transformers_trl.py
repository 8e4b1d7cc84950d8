"""The transformers integration under TRL's SFTTrainer (trl 1.16).

SFTTrainer computes its training loss with its own fused LM head: at construction it wraps the
model's forward (``trl.trainer.utils.add_fused_lm_head``) and ``compute_loss`` calls
``model(**inputs, fused_lm_head=True)``, which runs the backbone and TRL's chunked log-softmax
over ``lm_head.weight``, never the model's own forward with labels. So:

- a model patched by ``apply_fusedloss`` before the trainer is built trains exactly as the
  unpatched one under the default SFTTrainer, and fusedloss is never called;
- ``FusedLossSFTTrainer`` below (the model's own loss in training, as ``transformers.Trainer``
  computes it) makes the patched forward, hence fusedloss, compute the loss: losses and
  parameters after a few SGD steps equal the default SFTTrainer's on the unpatched model, with
  padding, gradient accumulation, completion-only labels (-100 on the prompt) and packing;
- patching after the trainer is built is refused (it would drop TRL's wrapper).

Tiny random models and an in-memory word-level tokenizer: no downloads.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
Dataset, SFTConfig, SFTTrainer = datasets.Dataset, trl.SFTConfig, trl.SFTTrainer

from test_transformers import OPTS, make_model  # noqa: E402
from transformers import PreTrainedTokenizerFast, Trainer  # noqa: E402

import fusedloss.integrations.transformers as integration  # noqa: E402
from fusedloss.integrations.transformers import (  # noqa: E402
    FusedLossUnsupportedError,
    apply_fusedloss,
)

logging.getLogger("trl").setLevel(logging.ERROR)


class FusedLossSFTTrainer(SFTTrainer):
    """SFTTrainer whose training loss is the model's own (``transformers.Trainer``'s
    ``compute_loss``: ``model(**inputs, num_items_in_batch=...)``), so that a model patched by
    ``apply_fusedloss`` computes it with fusedloss. Evaluation keeps SFTTrainer's loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training or return_outputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = {**inputs, "use_cache": False}
        return Trainer.compute_loss(self, model, inputs, num_items_in_batch=num_items_in_batch)


WORDS = ("the a cat dog bird sat ran flew on under mat log tree big small red blue fast slow "
         "and then it was very").split()


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory: ids 0-3 special, one id per word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


# Uneven lengths, so that batches are padded (labels -100 there).
TEXT = {"text": ["the cat sat on the mat", "a dog ran", "the big red bird flew under a tree",
                 "it was very slow and then it was fast"]}
PROMPT_COMPLETION = {"prompt": ["the cat", "a dog ran", "the big red", "it was"],
                     "completion": [" sat on the mat", " fast", " bird flew under the tree",
                                    " very slow and then it ran"]}


def train(model, trainer_cls=SFTTrainer, data=TEXT, steps=2, batch=2, accumulation=1,
          tmp_path=".", **config):
    """``steps`` SGD steps; returns (model, per-step logged losses, trainer)."""
    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=0.5,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=[],
        save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
        dataloader_num_workers=0, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_cls(model=model, args=args, train_dataset=Dataset.from_dict(data),
                              processing_class=make_tokenizer())
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == steps
    return trainer.model, losses, trainer


@pytest.fixture
def lce_calls(monkeypatch):
    """Counts the integration's calls of linear_cross_entropy."""
    calls = []
    real = integration.linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append({"target": args[2], **kwargs})
        return real(*args, **kwargs)

    monkeypatch.setattr(integration, "linear_cross_entropy", spy)
    return calls


def assert_params_equal(model, ref, start=None, rtol=1e-5, atol=1e-6):
    moved = False
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)
        if start is not None:
            moved |= not torch.equal(p, start[name])
    assert start is None or moved


# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [TEXT, PROMPT_COMPLETION], ids=["text", "prompt-completion"])
def test_default_sft_trainer_trains_unchanged(data, tmp_path, lce_calls):
    """The default SFTTrainer computes the loss with its own fused head: the patched model
    trains exactly as the unpatched one, and fusedloss is not called."""
    base = make_model()
    fused, losses, trainer = train(apply_fusedloss(copy.deepcopy(base), **OPTS), data=data,
                                   tmp_path=tmp_path)
    ref, ref_losses, _ = train(copy.deepcopy(base), data=data, tmp_path=tmp_path)
    assert not lce_calls
    assert losses == ref_losses
    assert_params_equal(fused, ref, rtol=0, atol=0)
    assert "mean_token_accuracy" in trainer.state.log_history[0]  # TRL's head's metrics


CASES = {
    "llama": dict(model_type="llama"),
    "gemma2-softcap": dict(model_type="gemma2"),
    "qwen2-tied": dict(model_type="qwen2", tie_word_embeddings=True),
    "accumulation": dict(batch=1, accumulation=2),
    "completion-only": dict(data=PROMPT_COMPLETION),
    "completion-only-accumulation": dict(data=PROMPT_COMPLETION, batch=1, accumulation=2),
    "packing": dict(packing=True, max_length=16),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_fused_loss_trainer_equals_sft_trainer(case, tmp_path, lce_calls):
    """FusedLossSFTTrainer on the patched model (fusedloss computes the loss) vs the default
    SFTTrainer on the unpatched model (TRL's head): equal losses at every step and equal
    parameters after the steps (fp32)."""
    kw = dict(CASES[case])
    model_type = kw.pop("model_type", "llama")
    overrides = {k: kw.pop(k) for k in ("tie_word_embeddings",) if k in kw}
    base = make_model(model_type, **overrides)
    start = {k: v.clone() for k, v in base.named_parameters()}
    fused, losses, _ = train(apply_fusedloss(copy.deepcopy(base), **OPTS), FusedLossSFTTrainer,
                             tmp_path=tmp_path, **kw)
    n_calls = len(lce_calls)
    assert n_calls == 2 * kw.get("accumulation", 1)  # one per micro-batch: the fused path ran
    # The Trainer passes num_items_in_batch (sum, then divided by the count) at every step.
    assert all(c["reduction"] == "sum" for c in lce_calls)
    if kw.get("data") is PROMPT_COMPLETION:  # the prompt's labels are -100
        assert all((c["target"][:, 0] == -100).all() for c in lce_calls)
    ref, ref_losses, _ = train(copy.deepcopy(base), tmp_path=tmp_path, **kw)
    assert len(lce_calls) == n_calls
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_params_equal(fused, ref, start)


def test_fused_loss_trainer_accumulation_equals_one_batch(tmp_path):
    """Two micro-batches of 1 with gradient accumulation == one batch of 2 (the sum over the
    valid tokens divided by their count over both micro-batches)."""
    base = make_model()
    data = PROMPT_COMPLETION
    two, _, _ = train(apply_fusedloss(copy.deepcopy(base), **OPTS), FusedLossSFTTrainer,
                      data=data, batch=1, accumulation=2, tmp_path=tmp_path)
    one, _, _ = train(apply_fusedloss(copy.deepcopy(base), **OPTS), FusedLossSFTTrainer,
                      data=data, batch=2, accumulation=1, tmp_path=tmp_path)
    assert_params_equal(two, one, {k: v for k, v in base.named_parameters()})


def test_fused_loss_trainer_triton_backend(tmp_path, triton_available):
    """The kernels (Triton's interpreter on the CPU) under the trainer, default options."""
    if not triton_available:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    base = make_model()
    fused, losses, _ = train(apply_fusedloss(copy.deepcopy(base), backend="triton"),
                             FusedLossSFTTrainer, data=PROMPT_COMPLETION, tmp_path=tmp_path)
    ref, ref_losses, _ = train(copy.deepcopy(base), data=PROMPT_COMPLETION, tmp_path=tmp_path)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_params_equal(fused, ref, rtol=1e-4, atol=1e-5)


def test_evaluate_keeps_trl_head(tmp_path, lce_calls):
    """Evaluation (model.eval()) goes through SFTTrainer's own loss and metrics, patched or
    not, with either trainer."""
    base = make_model()
    eval_dataset = Dataset.from_dict(PROMPT_COMPLETION)
    results = []
    for model, trainer_cls in ((apply_fusedloss(copy.deepcopy(base), **OPTS), FusedLossSFTTrainer),
                               (copy.deepcopy(base), SFTTrainer)):
        _, _, trainer = train(model, trainer_cls, steps=1, tmp_path=tmp_path)
        results.append(trainer.evaluate(eval_dataset))
    assert len(lce_calls) == 1  # the training step only
    assert "eval_mean_token_accuracy" in results[0]
    assert results[0]["eval_loss"] == pytest.approx(results[1]["eval_loss"], rel=1e-5)


def test_patching_after_the_trainer_is_refused(tmp_path):
    """SFTTrainer wraps the instance's forward; apply_fusedloss afterwards would replace that
    wrapper (TRL's compute_loss would then fail on the output), so it is refused by name."""
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[],
                     gradient_checkpointing=False, save_strategy="no")
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict(TEXT),
                   processing_class=make_tokenizer())
    with pytest.raises(FusedLossUnsupportedError, match="LlamaForCausalLM.*forward"):
        apply_fusedloss(model, **OPTS)
