"""Smoke tests of the end-to-end training suite (benchmarks/suites/train.py) on CPU.

The model configs, the max-batch search and the loss check are checked as pure helpers; the
end-to-end run is ``--quick`` (tiny configs) with HF eager and fusedloss's torch backend. The
peers' kernels need CUDA (they fail in Triton's interpreter), so their methods are checked
through stand-ins: the flags each liger method passes to a function with liger-kernel's
signature, and the generic cut-cross-entropy forward with a torch ``linear_cross_entropy``
against the unpatched model's loss and gradients. CUDA timing, memory figures and
torch.compile run only on a GPU.
"""

from __future__ import annotations

import inspect
import json
import sys
import types

import pytest
import torch
from helpers import import_benchmarks

common, train, run_module = import_benchmarks("common", "suites.train", "run")

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("name", "vocab", "hidden", "layers", "heads", "kv_heads", "intermediate"),
    [
        ("llama3.2-1b", 128256, 2048, 16, 32, 8, 8192),
        ("gemma2-2b", 256000, 2304, 26, 8, 4, 9216),
        ("qwen2.5-1.5b", 151936, 1536, 28, 12, 2, 8960),
    ],
)
def test_full_configs_have_the_published_sizes(
    name, vocab, hidden, layers, heads, kv_heads, intermediate
):
    spec = train.MODEL_SPECS[name]
    config = train.build_config(spec, quick=False)
    assert config.model_type == spec.model_type
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (
        vocab, hidden, layers)
    assert (config.num_attention_heads, config.num_key_value_heads) == (heads, kv_heads)
    assert config.intermediate_size == intermediate
    assert config.tie_word_embeddings is True
    # parameter count on the meta device, against the published sizes (tied: embedding once)
    facts = train._model_facts(spec, quick=False)
    expected = {"llama3.2-1b": 1.236e9, "gemma2-2b": 2.614e9, "qwen2.5-1.5b": 1.544e9}[name]
    assert facts["parameters"] == pytest.approx(expected, rel=0.01)


def test_gemma2_keeps_its_softcaps_and_quick_configs_are_tiny():
    full = train.build_config(train.MODEL_SPECS["gemma2-2b"], quick=False)
    assert full.final_logit_softcapping == 30.0 and full.attn_logit_softcapping == 50.0
    assert full.head_dim == 256 and full.query_pre_attn_scalar == 256
    for spec in train.MODEL_SPECS.values():
        quick = train.build_config(spec, quick=True)
        assert (quick.vocab_size, quick.hidden_size, quick.num_hidden_layers) == (512, 64, 2)
        assert quick.num_attention_heads * quick.head_dim == 64
    quick_gemma = train.build_config(train.MODEL_SPECS["gemma2-2b"], quick=True)
    assert quick_gemma.final_logit_softcapping == 30.0


def test_layers_replace_the_models_depth_only():
    """``--layers``: the real vocabulary and width with that many decoder layers."""
    for spec in train.MODEL_SPECS.values():
        config = train.build_config(spec, quick=False, layers=4)
        full = train.build_config(spec, quick=False)
        assert config.num_hidden_layers == 4 != full.num_hidden_layers
        assert (config.vocab_size, config.hidden_size) == (full.vocab_size, full.hidden_size)
    args = train.argparse.ArgumentParser()
    train.add_arguments(args)
    assert train.settings_from(args.parse_args(["--quick", "--layers", "1"])).layers == 1


def test_same_seed_same_model_and_batches():
    spec = train.MODEL_SPECS["qwen2.5-1.5b"]
    a = train.build_model(spec, quick=True, seed=3, device=CPU)
    b = train.build_model(spec, quick=True, seed=3, device=CPU)
    assert a.training and a.is_gradient_checkpointing and a.dtype == torch.bfloat16
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb)
    x = train.make_batch(512, 2, 8, seed=1, step=0, device=CPU)
    assert x.shape == (2, 8) and int(x.max()) < 512
    assert torch.equal(x, train.make_batch(512, 2, 8, seed=1, step=0, device=CPU))
    assert not torch.equal(x, train.make_batch(512, 2, 8, seed=1, step=1, device=CPU))


# ----------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    ("capacity", "start", "limit", "expected"),
    [
        (13, 2, 256, (13, False)),
        (16, 2, 256, (16, False)),
        (300, 2, 256, (256, True)),
        (1, 4, 256, (1, False)),
        (0, 4, 256, (None, False)),
        (5, 8, 8, (5, False)),
    ],
)
def test_find_max_batch(capacity, start, limit, expected):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= capacity

    assert train.find_max_batch(fits, start, limit) == expected
    assert len(tried) == len(set(tried)) and max(tried) <= limit


def result(method, **figures):
    defaults = dict(model="m", method=method, label=train.LABELS[method], batch=2, seq=10,
                    tokens_per_step=20, ms=1.0, losses=[5.0, 4.0])
    return train.MethodResult(**{**defaults, **figures})


def test_loss_check_marks_disagreeing_methods_wrong():
    results = [result("hf"), result("fusedloss", losses=[5.01, 4.02]),
               result("cce", losses=[5.5, 4.0]), result("liger", losses=[5.0, 4.5])]
    train.check_losses(results)
    assert [r.status for r in results] == ["ok", "ok", "wrong", "wrong"]
    assert results[1].loss_error == pytest.approx(0.02)
    assert "first-step" in results[2].note and "last-step" in results[3].note


# ----------------------------------------------------------------------------- peers


def fake_liger(monkeypatch, mlp_flag):
    """A ``liger_kernel.transformers`` whose apply functions have liger-kernel 0.8.5's
    signatures (``geglu`` instead of ``swiglu`` for Gemma) and record their arguments."""
    recorded = []
    module = types.ModuleType("liger_kernel.transformers")
    names = ("rope", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", mlp_flag)
    defaults = (True, False, True, True, True)
    parameters = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
                  for n, d in zip(names, defaults, strict=True)]
    parameters.append(inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=None))
    for family in ("llama", "gemma2", "qwen2"):
        def apply(**kwargs):
            recorded.append(kwargs)

        apply.__signature__ = inspect.Signature(parameters)
        setattr(module, f"apply_liger_kernel_to_{family}", apply)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    return recorded


@pytest.mark.parametrize(
    ("name", "mlp_flag"),
    [("llama3.2-1b", "swiglu"), ("gemma2-2b", "geglu"), ("qwen2.5-1.5b", "swiglu")],
)
def test_liger_methods_pass_their_kernel_flags(monkeypatch, name, mlp_flag):
    spec = train.MODEL_SPECS[name]
    recorded = fake_liger(monkeypatch, mlp_flag)
    model = object()
    # all kernels: only the loss flags; RoPE, RMSNorm and the MLP keep liger's defaults (on)
    patched, call = train.patch_liger("liger", model, spec)
    assert patched is model and recorded.pop() == dict(
        cross_entropy=False, fused_linear_cross_entropy=True, model=model)
    assert call.startswith(f"liger_kernel.transformers.apply_liger_kernel_to_{spec.liger_family}(")
    # loss only: every other kernel off
    patched, call = train.patch_liger("liger-flce", model, spec)
    assert patched is model and recorded.pop() == {
        "rope": False, "cross_entropy": False, "fused_linear_cross_entropy": True,
        "rms_norm": False, mlp_flag: False, "model": model}
    assert f"{mlp_flag}=False" in call and "rope=False" in call and "rms_norm=False" in call
    assert train.versioned_label("liger-flce", "0.8.5") == "liger-kernel 0.8.5 (loss only)"


def fake_cut_cross_entropy(monkeypatch):
    """A ``cut_cross_entropy`` whose ``linear_cross_entropy`` follows cut-cross-entropy's
    definition in float32 torch (shift, softcap, ignore_index, reduction) and records its
    keyword arguments."""
    recorded = []

    def linear_cross_entropy(e, c, targets, ignore_index=-100, softcap=None, reduction="mean",
                             shift=False, filter_eps="auto"):
        recorded.append(dict(ignore_index=ignore_index, softcap=softcap, reduction=reduction,
                             shift=shift, filter_eps=filter_eps))
        logits = e.float() @ c.float().T
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        if shift:
            logits, targets = logits[..., :-1, :], targets[..., 1:]
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index,
            reduction=reduction)

    module = types.ModuleType("cut_cross_entropy")
    module.linear_cross_entropy = linear_cross_entropy
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", module)
    return recorded


@pytest.mark.parametrize("exact", [False, True], ids=["cce", "cce-exact"])
@pytest.mark.parametrize("name", ["llama3.2-1b", "gemma2-2b"])
def test_cce_generic_forward_computes_the_family_loss(monkeypatch, name, exact):
    """The generic forward's loss (and gradients) equal the unpatched model's: labels shifted,
    ignored labels, num_items_in_batch, Gemma 2's softcap; ``exact`` passes filter_eps=None
    (else cut-cross-entropy's default filter). float32 models with a head scaled so that the
    logits are far from uniform (and beyond the softcap's linear range)."""
    recorded = fake_cut_cross_entropy(monkeypatch)
    spec = train.MODEL_SPECS[name]

    def model():
        built = train.build_model(spec, quick=True, seed=0, device=CPU).float()
        with torch.no_grad():
            built.lm_head.weight.mul_(300.0)
        return built

    reference, patched = model(), model()
    patched, call = train.patch_cce(patched, exact=exact)
    softcap = patched.config.final_logit_softcapping if name == "gemma2-2b" else None
    assert f"softcap={softcap}" in call and ("filter_eps=None" in call) == exact
    ids = train.make_batch(512, 2, 16, seed=0, step=0, device=CPU)
    labels = ids.clone()
    labels[0, :5] = -100
    for extra in ({}, {"num_items_in_batch": torch.tensor(7)}):
        expected = reference(input_ids=ids, labels=labels, **extra)
        output = patched(input_ids=ids, labels=labels, **extra)
        assert output.logits is None and float(expected.loss) > 1.0
        assert recorded.pop() == dict(ignore_index=-100, softcap=softcap, shift=True,
                                      reduction="sum" if extra else "mean",
                                      filter_eps=None if exact else "auto")
        torch.testing.assert_close(output.loss, expected.loss, rtol=1e-4, atol=1e-4)
        expected.loss.backward()
        output.loss.backward()
        for p, q in zip(reference.parameters(), patched.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5)
            p.grad = q.grad = None
    # evaluation and generation keep the original forward (logits)
    patched.eval()
    assert patched(input_ids=ids, labels=labels).logits is not None and not recorded


# ----------------------------------------------------------------------------- end to end


def test_quick_run_end_to_end(tmp_path, capsys):
    options = "train --quick --models llama3.2-1b,gemma2-2b " \
              "--methods hf,fusedloss,cce,cce-exact,liger,liger-flce " \
              "--find-max-batch"
    if torch.cuda.is_available():
        options += " --device cpu"
    assert run_module.main([*options.split(), "--out", str(tmp_path), "--tag", "t"]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("gemma2-2b")
    (json_path,) = tmp_path.glob("train_*_cpu_t.json")
    assert json_path.with_suffix(".md").exists()
    data = json.loads(json_path.read_text(encoding="utf-8"))
    assert [m["model"] for m in data["models"]] == ["llama3.2-1b", "gemma2-2b"]
    for model in data["models"]:
        assert model["vocab_size"] == 512 and model["parameters"] > 0
        by_method = {r["method"]: r for r in model["results"]}
        for peer in ("cce", "cce-exact", "liger", "liger-flce"):
            assert by_method[peer]["status"] in ("not installed", "unavailable")
        hf, ours = by_method["hf"], by_method["fusedloss"]
        for row in (hf, ours):
            assert row["status"] == "ok", row["note"]
            assert row["ms"] > 0 and row["tokens_per_s"] > 0 and len(row["losses"]) == 3
            assert row["max_batch"] == train.QUICK_MAX_BATCH_LIMIT == 8 and row["max_batch_limited"]
            assert [p["batch"] for p in row["sweep"]] == [2, 4, 8]
        assert ours["call"] == "apply_fusedloss(model, backend='torch')"
        assert ours["losses"][0] == pytest.approx(hf["losses"][0], abs=1e-2)
        assert ours["loss"] == pytest.approx(hf["loss"], abs=3e-2)
    assert data["settings"]["max_batch_limit"] == 8 and "targets" not in data


def test_module_patches_are_undone():
    module = types.ModuleType("fake_modeling")
    exec("class Model:\n    def forward(self):\n        return 'original'\n", module.__dict__)
    original_class = module.Model
    with train.module_patches_undone(module):
        module.Model.forward = lambda self: "patched"
        module.Model.extra = 1
        module.Model = type("Other", (), {})
        module.added = 2
    assert module.Model is original_class and module.Model().forward() == "original"
    assert not hasattr(module.Model, "extra") and not hasattr(module, "added")
