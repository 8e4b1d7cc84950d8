"""Smoke tests of the end-to-end training suite (benchmarks/suites/train.py) on CPU.

The model configs, the max-batch search and the loss check are checked as pure helpers; the
end-to-end run is ``--quick`` with HF eager and fusedloss's torch backend. The peers' kernels
need CUDA, so their methods are checked through stand-ins: the flags each liger method passes to
a function with liger-kernel's signature, and the generic cut-cross-entropy forward with a torch
``linear_cross_entropy`` against the unpatched model's loss and gradients.
"""

from __future__ import annotations

import inspect
import json
import sys
import types

import pytest
import torch
from helpers import import_benchmarks

common, train = import_benchmarks("common", "suites.train")

CPU = torch.device("cpu")


def settings(quick=True, layers=None, seed=0, seq=8):
    return types.SimpleNamespace(quick=quick, layers=layers, seed=seed, seq=seq)


@pytest.mark.parametrize(
    ("name", "vocab", "hidden", "layers", "heads", "kv_heads", "intermediate", "parameters"),
    [
        ("llama3.2-1b", 128256, 2048, 16, 32, 8, 8192, 1.236e9),
        ("gemma2-2b", 256000, 2304, 26, 8, 4, 9216, 2.614e9),
        ("qwen2.5-1.5b", 151936, 1536, 28, 12, 2, 8960, 1.544e9),
    ],
)
def test_full_configs_have_the_published_sizes(
    name, vocab, hidden, layers, heads, kv_heads, intermediate, parameters
):
    model = train.build_model(name, settings(quick=False), "meta")
    config = model.config
    assert config.model_type == train.MODEL_CONFIGS[name]["model_type"]
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (
        vocab, hidden, layers)
    assert (config.num_attention_heads, config.num_key_value_heads) == (heads, kv_heads)
    assert config.intermediate_size == intermediate and config.tie_word_embeddings is True
    # the published parameter counts (tied: the embedding once)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(parameters, rel=0.01)


def test_gemma2_keeps_its_softcaps_and_quick_configs_are_tiny():
    full = train.build_model("gemma2-2b", settings(quick=False), "meta").config
    assert full.final_logit_softcapping == 30.0 and full.attn_logit_softcapping == 50.0
    assert full.head_dim == 256 and full.query_pre_attn_scalar == 256
    for name in train.MODEL_CONFIGS:
        quick = train.build_model(name, settings(), "meta").config
        assert (quick.vocab_size, quick.hidden_size, quick.num_hidden_layers) == (512, 64, 2)
        assert quick.num_attention_heads * quick.head_dim == 64
    assert train.build_model("gemma2-2b", settings(), "meta").config.final_logit_softcapping == 30
    # --layers: that many decoder layers, the real vocabulary and width
    for name in train.MODEL_CONFIGS:
        config = train.build_model(name, settings(quick=False, layers=4), "meta").config
        assert config.num_hidden_layers == 4
        assert config.vocab_size == train.MODEL_CONFIGS[name]["vocab_size"]


def test_same_seed_same_model_and_batches():
    a = train.build_model("qwen2.5-1.5b", settings(seed=3), CPU)
    b = train.build_model("qwen2.5-1.5b", settings(seed=3), CPU)
    assert a.training and a.is_gradient_checkpointing and a.dtype == torch.bfloat16
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb)
    seen = []

    def step(ids):
        seen.append(ids)
        return torch.tensor(float(len(seen)))

    point, losses = train.measure(step, 512, 2, settings(seed=1), CPU, 0, warmup=1, steps=2)
    assert losses == [1.0, 2.0, 3.0] and len(point["step_ms"]) == 2
    assert point["tokens"] == 16 and point["tokens_per_s"] > 0 and point["peak_gib"] is None
    assert seen[0].shape == (2, 8) and int(max(ids.max() for ids in seen)) < 512
    assert not torch.equal(seen[0], seen[1])
    train.measure(step, 512, 2, settings(seed=1), CPU, 0, warmup=0, steps=1)
    assert torch.equal(seen[0], seen[3])


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


def test_loss_check_marks_disagreeing_methods_wrong():
    def result(method, losses):
        return common.new_row(method, train.LABELS[method], method=method, ms=1.0, losses=losses)

    results = [result("hf", [5.0, 4.0]), result("fusedloss", [5.01, 4.02]),
               result("cce", [5.5, 4.0]), result("liger", [5.0, 4.5])]
    train.check_losses(results)
    assert [r["status"] for r in results] == ["ok", "ok", "wrong", "wrong"]
    assert results[1]["loss_error"] == pytest.approx(0.02)
    assert "first-step" in results[2]["note"] and "last-step" in results[3]["note"]
    assert "HF eager" in results[3]["note"]


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
    recorded = fake_liger(monkeypatch, mlp_flag)
    model = types.SimpleNamespace(config=types.SimpleNamespace(
        model_type=train.MODEL_CONFIGS[name]["model_type"]))
    # all kernels: only the loss flags; RoPE, RMSNorm and the MLP keep liger's defaults (on)
    call = train.patch_liger("liger", model)
    assert recorded.pop() == dict(cross_entropy=False, fused_linear_cross_entropy=True,
                                  model=model)
    assert call.startswith(
        f"liger_kernel.transformers.apply_liger_kernel_to_{model.config.model_type}(")
    # loss only: every other kernel off
    call = train.patch_liger("liger-flce", model)
    assert recorded.pop() == {
        "rope": False, "cross_entropy": False, "fused_linear_cross_entropy": True,
        "rms_norm": False, mlp_flag: False, "model": model}
    assert f"{mlp_flag}=False" in call and "rope=False" in call and "rms_norm=False" in call


def fake_cut_cross_entropy(monkeypatch):
    """A ``cut_cross_entropy`` whose ``linear_cross_entropy`` follows cut-cross-entropy's
    definition in float32 torch (shift, softcap, ignore_index) and records its keywords."""
    recorded = []

    def linear_cross_entropy(e, c, targets, ignore_index=-100, softcap=None, shift=False,
                             filter_eps="auto"):
        recorded.append(dict(softcap=softcap, shift=shift, filter_eps=filter_eps))
        logits = e.float() @ c.float().T
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        if shift:
            logits, targets = logits[..., :-1, :], targets[..., 1:]
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)

    module = types.ModuleType("cut_cross_entropy")
    module.linear_cross_entropy = linear_cross_entropy
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", module)
    return recorded


@pytest.mark.parametrize("exact", [False, True], ids=["cce", "cce-exact"])
@pytest.mark.parametrize("name", ["llama3.2-1b", "gemma2-2b"])
def test_cce_generic_forward_computes_the_family_loss(monkeypatch, name, exact):
    """The generic forward's loss (and gradients) equal the unpatched model's: labels shifted,
    ignored labels, Gemma 2's softcap; ``exact`` passes filter_eps=None (else cut-cross-entropy's
    default filter). float32 models with a head scaled so that the logits are far from uniform
    (and beyond the softcap's linear range)."""
    recorded = fake_cut_cross_entropy(monkeypatch)

    def model():
        built = train.build_model(name, settings(), CPU).float()
        with torch.no_grad():
            built.lm_head.weight.mul_(300.0)
        return built

    reference, patched = model(), model()
    call = train.patch_cce(patched, exact=exact)
    softcap = patched.config.final_logit_softcapping if name == "gemma2-2b" else None
    assert f"softcap={softcap}" in call and ("filter_eps=None" in call) == exact
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100
    expected = reference(input_ids=ids, labels=labels)
    output = patched(input_ids=ids, labels=labels)
    assert output.logits is None and expected.loss.item() > 1.0
    assert recorded.pop() == dict(softcap=softcap, shift=True,
                                  filter_eps=None if exact else "auto")
    torch.testing.assert_close(output.loss, expected.loss, rtol=1e-4, atol=1e-4)
    expected.loss.backward()
    output.loss.backward()
    for p, q in zip(reference.parameters(), patched.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5)
    # evaluation and generation keep the original forward (logits)
    patched.eval()
    assert patched(input_ids=ids, labels=labels).logits is not None and not recorded


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path):
    parser = train.argparse.ArgumentParser()
    train.add_arguments(parser)
    options = ["--quick", "--models", "llama3.2-1b,gemma2-2b", "--steps", "2",
               "--warmup-steps", "1", "--methods", "hf,hf-compile,fusedloss,cce,liger-flce",
               "--find-max-batch", "--out", str(tmp_path), "--tag", "t", "--device", "cpu"]
    printed = []
    assert train.run(parser.parse_args(options), log=printed.append) == 0
    assert printed[-1].splitlines()[-1].startswith("gemma2-2b")  # the table, last
    (json_path,) = tmp_path.glob("train_*_cpu_t.json")
    markdown = json_path.with_suffix(".md").read_text(encoding="utf-8")
    assert "## Results" in markdown and "## Batches tried" in markdown
    assert json_path.with_suffix(".png").exists() or "no plot" in markdown
    data = json.loads(json_path.read_text(encoding="utf-8"))
    assert data["settings"]["max_batch_limit"] == 8 and data["settings"]["seq"] == 32
    rows = {(r["model"], r["method"]): r for r in data["results"]}
    assert len(rows) == 10
    for model in ("llama3.2-1b", "gemma2-2b"):
        for method in ("hf-compile", "cce", "liger-flce"):
            assert rows[model, method]["status"] in ("not installed", "unavailable")
        hf, ours = rows[model, "hf"], rows[model, "fusedloss"]
        for row in (hf, ours):
            assert row["status"] == "ok", row["note"]
            assert row["ms"] > 0 and len(row["losses"]) == 3
            assert row["max_batch"] == 8 and row["max_batch_limited"]
            assert [p["batch"] for p in row["sweep"]] == [2, 4, 8]
            assert all(p["status"] == "ok" and p["tokens_per_s"] > 0 for p in row["sweep"])
        assert ours["call"] == "apply_fusedloss(model, backend='torch')"
        assert ours["losses"][0] == pytest.approx(hf["losses"][0], abs=1e-2)
        assert ours["losses"][-1] == pytest.approx(hf["losses"][-1], abs=3e-2)


def test_full_size_needs_cuda():
    parser = train.argparse.ArgumentParser()
    train.add_arguments(parser)
    assert train.run(parser.parse_args(["--device", "cpu"]), log=lambda _: None) == 2
