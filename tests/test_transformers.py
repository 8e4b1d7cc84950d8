"""The Hugging Face transformers integration (fusedloss.integrations.transformers).

Tiny random models of each supported family (no downloads), patched vs. an unpatched deep
copy: loss and every parameter gradient equal in fp32; -100 labels, shift_labels,
num_items_in_batch, tied embeddings, MoE auxiliary losses, labels=None / eval / generate()
unchanged, Trainer gradient accumulation, PEFT's ModulesToSaveWrapper, the refusals, and the
patched forward under torch.compile(fullgraph=True).
"""

from __future__ import annotations

import copy
import inspect
import logging
import warnings

import pytest
import torch
from helpers import counting_training_path
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from fusedloss.integrations.transformers import (  # noqa: E402
    SUPPORTED_FAMILIES,
    AutoFusedLossForCausalLM,
    FusedLossUnsupportedError,
    _check_source,
    _Family,
    apply_fusedloss,
    is_fusedloss_applied,
    remove_fusedloss,
)

transformers.utils.logging.set_verbosity_error()
logging.getLogger("transformers").setLevel(logging.ERROR)

V = 300
OPTS = {"backend": "torch"}  # CPU: the chunked PyTorch path (the Triton path is tested elsewhere)

# Per-family config fields: MoE sizes, and head transforms at values that matter.
_EXTRA = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "full_attention"]},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "minimax": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma2": {"final_logit_softcapping": 0.5},
    "gemma3_text": {"final_logit_softcapping": 0.5},
    "vaultgemma": {"final_logit_softcapping": 0.5},
    "nanochat": {"final_logit_softcapping": 0.5},
    "cohere": {"logit_scale": 2.5},
    "cohere2": {"logit_scale": 2.5},
    "granite": {"logits_scaling": 0.25},
    "granite_swa": {"logits_scaling": 0.25},
}


def make_model(model_type: str = "llama", seed: int = 0, **overrides) -> nn.Module:
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    kw.update(_EXTRA.get(model_type, {}))
    kw.update(overrides)
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def pair(model_type: str = "llama", **overrides):
    """(unpatched, patched deep copy), both in training mode."""
    ref = make_model(model_type, **overrides).train()
    fused = apply_fusedloss(copy.deepcopy(ref), **OPTS).train()
    return ref, fused


def batch(b: int = 2, t: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt, masked
    labels[-1, -2:] = -100
    mask = torch.ones_like(ids)
    mask[-1, -2:] = 0  # right padding
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run(model, inputs, seed: int = 5):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # families with dropout / router jitter in training
    out = model(**inputs)
    out.loss.backward()
    return out


def assert_grads_equal(ref, fused, rtol=1e-5, atol=1e-6):
    pairs = list(zip(ref.named_parameters(), fused.named_parameters(), strict=True))
    n = 0
    for (name, p1), (_, p2) in pairs:
        if p1.grad is None:
            assert p2.grad is None or not p2.grad.any(), name
            continue
        n += 1
        assert p2.grad is not None, name
        torch.testing.assert_close(p2.grad, p1.grad, rtol=rtol, atol=atol, msg=name)
    assert n > 0


def assert_same(ref, fused, inputs, **kw):
    o1, o2 = run(ref, inputs), run(fused, inputs)
    assert o2.logits is None  # the fused path ran
    assert type(o2) is type(o1)
    torch.testing.assert_close(o2.loss, o1.loss, rtol=1e-5, atol=1e-6)
    assert_grads_equal(ref, fused, **kw)
    return o1, o2


# ------------------------------------------------------------------------------------------
# Equality over the families


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_FAMILIES))
def test_family_loss_and_gradients_equal(model_type):
    ref, fused = pair(model_type)
    family = SUPPORTED_FAMILIES[model_type]
    inputs = batch()
    if family.moe:
        inputs["output_router_logits"] = True
    o1, o2 = assert_same(ref, fused, inputs)
    if family.moe:
        assert o1.aux_loss is not None
        torch.testing.assert_close(o2.aux_loss, o1.aux_loss)
    if family.head == "softcap":
        assert ref.config.final_logit_softcapping == 0.5


def test_head_transforms_matter():
    """The test configs' softcap / scales change the loss: the equality above checks them."""
    for model_type, field, neutral in (("gemma2", "final_logit_softcapping", None),
                                       ("cohere", "logit_scale", 1.0),
                                       ("granite", "logits_scaling", 1.0)):
        ref, _ = pair(model_type)
        plain = make_model(model_type, **{field: neutral}).train()
        inputs = batch()
        assert not torch.allclose(run(ref, inputs).loss, run(plain, inputs).loss)


def test_moe_aux_loss_from_config_and_off():
    ref, fused = pair("mixtral", output_router_logits=True)
    o1, o2 = assert_same(ref, fused, batch())
    torch.testing.assert_close(o2.aux_loss, o1.aux_loss)
    ref, fused = pair("qwen3_moe")
    inputs = {**batch(), "output_router_logits": False}
    _, o2 = assert_same(ref, fused, inputs)
    assert o2.aux_loss is None


# ------------------------------------------------------------------------------------------
# The loss's options


def test_shift_labels_given_by_the_caller():
    ref, fused = pair("qwen3")
    inputs = batch()
    g = torch.Generator().manual_seed(3)
    shift_labels = torch.randint(0, V, inputs["labels"].shape, generator=g)
    shift_labels[:, -1] = -100
    shift_labels[1, :3] = -100
    assert_same(ref, fused, {**inputs, "shift_labels": shift_labels})


@pytest.mark.parametrize("num_items", [7, "tensor"])
def test_num_items_in_batch(num_items):
    ref, fused = pair("gemma2")
    n = torch.tensor(13) if num_items == "tensor" else num_items
    o1, _ = assert_same(ref, fused, {**batch(), "num_items_in_batch": n})
    # It is a sum divided by the count, not a mean.
    plain = run(ref, batch()).loss
    assert not torch.allclose(o1.loss, plain)


def test_all_labels_ignored():
    ref, fused = pair()
    inputs = batch()
    inputs["labels"] = torch.full_like(inputs["labels"], -100)
    out = run(fused, {**inputs, "num_items_in_batch": torch.tensor(1)})
    assert out.loss.item() == 0.0
    assert torch.isnan(run(ref, inputs).loss)  # PyTorch's mean over no tokens; fusedloss gives 0
    out = run(fused, inputs)
    assert out.loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in fused.parameters())


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tied_embeddings(model_type):
    ref, fused = pair(model_type, tie_word_embeddings=True)
    assert fused.lm_head.weight is fused.model.embed_tokens.weight
    assert_same(ref, fused, batch())


def test_lm_head_bias():
    ref = make_model().train()
    ref.lm_head.bias = nn.Parameter(torch.randn(V) * 0.5)
    fused = apply_fusedloss(copy.deepcopy(ref), **OPTS)
    assert_same(ref, fused, batch())
    assert fused.lm_head.bias.grad is not None


def test_options_reach_linear_cross_entropy(monkeypatch):
    import fusedloss.integrations.transformers as integration

    seen = {}
    real = integration.linear_cross_entropy

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(integration, "linear_cross_entropy", spy)
    model = apply_fusedloss(make_model("gemma2").train(), backend="torch", filter_eps=None,
                            z_loss=1e-4)
    model(**batch())
    assert seen["backend"] == "torch" and seen["filter_eps"] is None
    assert seen["z_loss"] == 1e-4 and seen["softcap"] == 0.5 and seen["shift"] is True
    with pytest.raises(TypeError, match="unknown options"):
        apply_fusedloss(make_model(), reduction="sum")


# ------------------------------------------------------------------------------------------
# Behaviour outside the fused path: exactly the original's


def test_signature_and_unpatching():
    ref, fused = pair()
    assert inspect.signature(fused.forward) == inspect.signature(ref.forward)
    assert is_fusedloss_applied(fused) and not is_fusedloss_applied(ref)
    remove_fusedloss(fused)
    assert not is_fusedloss_applied(fused)
    assert run(fused, batch()).logits is not None


def test_without_labels_and_in_eval_unchanged():
    ref, fused = pair("gemma2")
    inputs = batch()
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        o1, o2 = ref(**no_labels), fused(**no_labels)
        assert o2.loss is None
        torch.testing.assert_close(o2.logits, o1.logits, rtol=0, atol=0)
        ref.eval()
        fused.eval()
        o1, o2 = ref(**inputs), fused(**inputs)  # eval with labels: logits and loss
        torch.testing.assert_close(o2.logits, o1.logits, rtol=0, atol=0)
        torch.testing.assert_close(o2.loss, o1.loss, rtol=0, atol=0)
        # logits_to_keep: the original forward (generation's path)
        o1 = ref(**no_labels, logits_to_keep=1)
        o2 = fused(**no_labels, logits_to_keep=1)
        assert o2.logits.shape == (2, 1, V)
        torch.testing.assert_close(o2.logits, o1.logits, rtol=0, atol=0)


def test_fuse_in_eval():
    ref = make_model().eval()
    fused = apply_fusedloss(copy.deepcopy(ref), fuse_in_eval=True, **OPTS)
    with torch.no_grad():
        o1, o2 = ref(**batch()), fused(**batch())
    assert o2.logits is None
    torch.testing.assert_close(o2.loss, o1.loss, rtol=1e-5, atol=1e-6)


def test_return_dict_false():
    ref, fused = pair("mixtral")
    inputs = {**batch(), "output_router_logits": True, "return_dict": False}
    torch.manual_seed(5)
    out1 = ref(**inputs)
    torch.manual_seed(5)
    out2 = fused(**inputs)
    assert isinstance(out2, tuple)
    torch.testing.assert_close(out2[0], out1[0], rtol=1e-5, atol=1e-6)  # loss
    torch.testing.assert_close(out2[1], out1[1])  # aux_loss (logits None: left out)


def test_positional_arguments():
    ref, fused = pair()
    b = batch()
    torch.manual_seed(5)
    o1 = ref(b["input_ids"], b["attention_mask"], None, None, None, b["labels"])
    o2 = fused(b["input_ids"], b["attention_mask"], None, None, None, b["labels"])
    assert o2.logits is None
    torch.testing.assert_close(o2.loss, o1.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_moe"])
def test_generate_unchanged(model_type):
    ref, fused = pair(model_type)
    ref.eval()
    fused.eval()
    prompt = batch(b=2, t=5)["input_ids"]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(fused.generate(prompt, **kw), ref.generate(prompt, **kw))
    fused.train()  # generate() passes no labels: same in training mode
    assert torch.equal(fused.generate(prompt, **kw), ref.generate(prompt, **kw))


def test_gradient_checkpointing():
    ref, fused = pair()
    for m in (ref, fused):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.config.use_cache = False
    assert_same(ref, fused, batch())


def test_autocast_bf16():
    ref, fused = pair()
    inputs = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o1, o2 = run(ref, inputs), run(fused, inputs)
    torch.testing.assert_close(o2.loss, o1.loss, rtol=2e-2, atol=2e-2)


def test_bf16_model():
    ref = make_model().to(torch.bfloat16).train()
    fused = apply_fusedloss(copy.deepcopy(ref), **OPTS)
    o1, o2 = run(ref, batch()), run(fused, batch())
    assert o2.logits is None and o2.loss.dtype == torch.float32
    torch.testing.assert_close(o2.loss, o1.loss, rtol=1e-2, atol=1e-2)
    for p1, p2 in zip(ref.parameters(), fused.parameters(), strict=True):
        assert p2.grad.dtype == torch.bfloat16
        torch.testing.assert_close(p2.grad.float(), p1.grad.float(), rtol=0.1, atol=2e-2)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_triton_backend(model_type, triton_available):
    """The kernels (on the GPU, or Triton's interpreter on the CPU) through the integration,
    default options (filter_eps="auto": exact in fp32): a training step takes the LM head's
    training path (core.chunked_logits)."""
    if not triton_available:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels' device
    ref = make_model(model_type).train().to(device)
    fused = apply_fusedloss(copy.deepcopy(ref), backend="triton")
    inputs = {k: t.to(device) for k, t in batch(b=2, t=8).items()}
    with counting_training_path("loss_and_grads") as calls:
        assert_same(ref, fused, inputs, rtol=1e-4, atol=1e-5)
    # a training step takes the LM head's training path: for these 16 tokens the loss in the
    # forward, the gradients in the backward (config.lm_head_deferred)
    assert calls == [1, 1]


def test_auto_class(tmp_path):
    config = make_model().config
    model = AutoFusedLossForCausalLM.from_config(config, backend="torch")
    assert is_fusedloss_applied(model) and model._fusedloss_state.options == OPTS
    ref = make_model()
    ref.save_pretrained(tmp_path)
    model = AutoFusedLossForCausalLM.from_pretrained(tmp_path, backend="torch", filter_eps=None)
    assert is_fusedloss_applied(model)
    assert model._fusedloss_state.options == {"backend": "torch", "filter_eps": None}
    assert_same(ref.train(), model.train(), batch())
    with pytest.raises(OSError):
        AutoFusedLossForCausalLM()


# ------------------------------------------------------------------------------------------
# PEFT's wrappers (PEFT itself need not be installed: these mirror its attributes)


class ModulesToSaveWrapper(nn.Module):
    """What peft.utils.other.ModulesToSaveWrapper exposes: the original module and one
    trainable copy per adapter, the active one used unless adapters are disabled."""

    def __init__(self, module):
        super().__init__()
        self.original_module = module
        self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(module)})
        self.active_adapters = ["default"]
        self.disable_adapters = False
        module.requires_grad_(False)

    def forward(self, x):
        if self.disable_adapters:
            return self.original_module(x)
        return self.modules_to_save[self.active_adapters[0]](x)


class FakeLoraLinear(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base_layer = base
        self.active_adapters = ["default"]
        self.lora_A = nn.Linear(base.in_features, 2, bias=False)
        self.lora_B = nn.Linear(2, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_modules_to_save_wrapper_unwrapped():
    ref = make_model().train()
    ref.lm_head = ModulesToSaveWrapper(ref.lm_head)
    with torch.no_grad():
        ref.lm_head.modules_to_save["default"].weight.add_(0.05)
    fused = apply_fusedloss(copy.deepcopy(ref), **OPTS)
    assert_same(ref, fused, batch())
    assert fused.lm_head.modules_to_save["default"].weight.grad is not None
    for m in (ref, fused):
        m.lm_head.disable_adapters = True
    assert_same(ref, fused, batch())


def test_real_peft_modules_to_save():
    peft = pytest.importorskip("peft")
    ref = make_model().train()
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                             modules_to_save=["lm_head"])
    ref = peft.get_peft_model(ref, config)
    fused = apply_fusedloss(copy.deepcopy(ref), **OPTS)
    assert is_fusedloss_applied(fused)
    assert type(fused.base_model.model.lm_head).__name__ == "ModulesToSaveWrapper"
    assert_same(ref, fused, batch())
    lora_head = peft.get_peft_model(make_model(), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(FusedLossUnsupportedError, match="LlamaForCausalLM.*tuner layer"):
        apply_fusedloss(lora_head)


# ------------------------------------------------------------------------------------------
# Refusals


def test_refuses_unsupported_family():
    model = make_model("gpt2", n_embd=32, n_layer=1, n_head=4)
    with pytest.raises(FusedLossUnsupportedError, match="GPT2LMHeadModel"):
        apply_fusedloss(model)
    with pytest.raises(FusedLossUnsupportedError, match="no lm_head|not a supported"):
        apply_fusedloss(nn.Linear(2, 2))


def test_refuses_subclass_overriding_forward():
    from transformers import LlamaForCausalLM

    class Custom(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = Custom(make_model().config)
    with pytest.raises(FusedLossUnsupportedError, match="Custom"):
        apply_fusedloss(model)


def test_refuses_pretraining_tp():
    model = make_model(pretraining_tp=2)
    with pytest.raises(FusedLossUnsupportedError, match="LlamaForCausalLM.*pretraining_tp"):
        apply_fusedloss(model)


def test_refuses_lora_on_lm_head():
    model = make_model()
    model.lm_head = FakeLoraLinear(model.lm_head)
    with pytest.raises(FusedLossUnsupportedError, match="LlamaForCausalLM.*tuner layer"):
        apply_fusedloss(model)


def test_refuses_unknown_heads():
    class MyHead(nn.Linear):
        pass

    model = make_model()
    model.lm_head = MyHead(32, V, bias=False)
    with pytest.raises(FusedLossUnsupportedError, match="unknown head transform.*MyHead"):
        apply_fusedloss(model)
    model = make_model()
    model.lm_head.register_forward_hook(lambda m, i, o: o * 2)
    with pytest.raises(FusedLossUnsupportedError, match="forward hooks"):
        apply_fusedloss(model)


def test_refuses_a_forward_that_differs_from_the_known_one():
    from transformers import Gemma2ForCausalLM, LlamaForCausalLM, MixtralForCausalLM

    _check_source(Gemma2ForCausalLM, SUPPORTED_FAMILIES["gemma2"])
    llama = SUPPORTED_FAMILIES["llama"]
    with pytest.raises(FusedLossUnsupportedError, match="Gemma2ForCausalLM.*head"):
        _check_source(Gemma2ForCausalLM, llama)  # a softcap the plain family lacks
    with pytest.raises(FusedLossUnsupportedError, match="LlamaForCausalLM"):
        _check_source(LlamaForCausalLM, _Family("LlamaForCausalLM", "", "softcap"))
    with pytest.raises(FusedLossUnsupportedError, match="LlamaForCausalLM"):
        _check_source(LlamaForCausalLM, _Family("LlamaForCausalLM", "", "plain", moe=True))
    _check_source(MixtralForCausalLM, SUPPORTED_FAMILIES["mixtral"])


# ------------------------------------------------------------------------------------------
# Trainer: gradient accumulation over two micro-batches equals one batch


class _Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(11)
        self.ids = torch.randint(3, V, (4, 10), generator=g)
        self.labels = self.ids.clone()
        for i, n in enumerate((0, 7, 2, 5)):  # uneven valid-token counts per sample
            self.labels[i, :n] = -100

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _train_one_step(model, tmp_path, micro_batch, accumulation):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, seed=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=_Data()).train()
    return model


def test_trainer_gradient_accumulation(tmp_path):
    pytest.importorskip("accelerate")
    base = make_model()
    base.config.use_cache = False
    start = {k: v.clone() for k, v in base.state_dict().items()}
    one = _train_one_step(apply_fusedloss(copy.deepcopy(base), **OPTS), tmp_path, 4, 1)
    two = _train_one_step(apply_fusedloss(copy.deepcopy(base), **OPTS), tmp_path, 2, 2)
    ref = _train_one_step(copy.deepcopy(base), tmp_path, 2, 2)
    ref_one = _train_one_step(copy.deepcopy(base), tmp_path, 4, 1)
    moved = False
    for name, p in one.state_dict().items():
        torch.testing.assert_close(two.state_dict()[name], p, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(ref.state_dict()[name], p, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(ref_one.state_dict()[name], p, rtol=1e-5, atol=1e-6, msg=name)
        moved |= not torch.equal(p, start[name])
    assert moved


# ------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("model_type", ["llama", pytest.param("gemma2", marks=pytest.mark.slow),
                                        "cohere"])
def test_compile_fullgraph(model_type):
    ref, fused = pair(model_type)
    for m in (ref, fused):
        m.config.use_cache = False
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    # No MoE family here: in transformers 5.17 + torch 2.13 the unpatched MoE models do not
    # compile with fullgraph=True either (the router-logit capture's lock; the experts'
    # grouped-mm fallback's data-dependent backward).
    inputs = batch()
    o1 = run(ref, inputs)
    o2 = run(compiled, inputs)
    assert o2.logits is None
    torch.testing.assert_close(o2.loss, o1.loss, rtol=1e-5, atol=1e-6)
    assert_grads_equal(ref, fused)
