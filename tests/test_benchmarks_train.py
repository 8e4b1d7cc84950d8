"""Smoke tests of the end-to-end training suite (benchmarks/suites/train.py) on CPU.

The model configs, the max-batch search, the loss check and the targets are checked as pure
helpers; the end-to-end run is ``--quick`` (tiny configs) with HF eager and fusedloss's torch
backend. CUDA timing, memory figures, torch.compile, liger-kernel and cut-cross-entropy run
only on a GPU and are not tested here.
"""

from __future__ import annotations

import json

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


def test_targets():
    results = [
        result("hf", tokens_per_s=100.0, peak_gib=30.0, max_batch=4, max_batch_tokens_per_s=150.0),
        result("liger", tokens_per_s=120.0, peak_gib=20.0, max_batch=8,
               max_batch_tokens_per_s=160.0),
        result("cce", status="not installed", ms=None),
        result("fusedloss", tokens_per_s=130.0, peak_gib=18.0, max_batch=16,
               max_batch_tokens_per_s=155.0),
        result("fusedloss-compile", status="unavailable", ms=None),
    ]
    outcomes = train.evaluate_targets("m", results)
    by_description = {o.target.description: o for o in outcomes}
    assert {o.target.provider for o in outcomes} == {"fusedloss"}
    assert by_description["lowest peak memory of all methods"].status == common.PASS
    assert by_description["largest tokens per step of all methods"].status == common.PASS
    assert by_description["tokens/s at batch 2 ≥ liger-kernel's"].status == common.PASS
    assert by_description["tokens/s at batch 2 ≥ cut-cross-entropy's"].status.startswith("n/a")
    at_max = by_description["tokens/s at own largest batch ≥ every other's at theirs"]
    assert at_max.status == common.FAIL and "liger-kernel" in at_max.measured
    # without memory figures or a search: n/a, never a pass
    bare = train.evaluate_targets("m", [result("hf"), result("fusedloss")])
    assert all(o.status.startswith("n/a") for o in bare)


# ----------------------------------------------------------------------------- end to end


def test_quick_run_end_to_end(tmp_path, capsys):
    options = "train --quick --models llama3.2-1b,gemma2-2b --methods hf,fusedloss,cce " \
              "--find-max-batch --max-batch-limit 4"
    if torch.cuda.is_available():
        options += " --device cpu"
    assert run_module.main([*options.split(), "--out", str(tmp_path), "--tag", "t"]) == 0
    printed = capsys.readouterr().out
    assert "targets" in printed and printed.rstrip().splitlines()[-1].startswith("gemma2-2b")
    (json_path,) = tmp_path.glob("train_*_cpu_t.json")
    assert json_path.with_suffix(".md").exists()
    data = json.loads(json_path.read_text(encoding="utf-8"))
    assert [m["model"] for m in data["models"]] == ["llama3.2-1b", "gemma2-2b"]
    for model in data["models"]:
        assert model["vocab_size"] == 512 and model["parameters"] > 0
        by_method = {r["method"]: r for r in model["results"]}
        assert by_method["cce"]["status"] in ("not installed", "unavailable")
        hf, ours = by_method["hf"], by_method["fusedloss"]
        for row in (hf, ours):
            assert row["status"] == "ok", row["note"]
            assert row["ms"] > 0 and row["tokens_per_s"] > 0 and len(row["losses"]) == 3
            assert row["max_batch"] == 4 and row["max_batch_limited"]
            assert [p["batch"] for p in row["sweep"]] == [2, 4]
        assert ours["call"] == "apply_fusedloss(model, backend='torch')"
        assert ours["losses"][0] == pytest.approx(hf["losses"][0], abs=1e-2)
        assert ours["loss"] == pytest.approx(hf["loss"], abs=3e-2)
    assert any(t["provider"] == "fusedloss" for t in data["targets"])


def test_module_patches_are_undone():
    import types

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
