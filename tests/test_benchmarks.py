"""Smoke tests of the benchmark runner's logic (benchmarks/): no CUDA needed, a few seconds.

Inputs, the float64 reference, the target checks and the results files are checked on
CPU; the end-to-end run uses ``--quick`` with torch eager only. Timing through
``triton.testing.do_bench`` and memory figures need CUDA and are tested only there.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import can_run_triton, import_benchmarks, read_results, requires_cuda

import fusedloss

common, inputs, providers, lm_head, run_module = import_benchmarks(
    "common", "inputs", "providers", "suites.lm_head", "run"
)


def mean_cross_entropy(hidden: torch.Tensor, classifier: torch.Tensor, labels) -> float:
    return float(F.cross_entropy(hidden.double() @ classifier.double().T, labels))


# ----------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("regime", inputs.REGIMES)
def test_inputs_shapes_dtypes_and_seed(regime):
    hidden, classifier, labels = inputs.make_lm_head_inputs(37, 501, 24, regime, seed=3)
    assert hidden.shape == (37, 24) and hidden.dtype == torch.bfloat16
    assert classifier.shape == (501, 24) and classifier.dtype == torch.bfloat16
    assert labels.shape == (37,) and labels.dtype == torch.int64
    assert 0 <= int(labels.min()) and int(labels.max()) < 501
    again = inputs.make_lm_head_inputs(37, 501, 24, regime, seed=3)
    assert all(torch.equal(a, b) for a, b in zip((hidden, classifier, labels), again, strict=True))
    other = inputs.make_lm_head_inputs(37, 501, 24, regime, seed=4)
    assert not torch.equal(hidden, other[0])
    fp32 = inputs.make_lm_head_inputs(5, 11, 3, regime, dtype=torch.float32)
    assert fp32[0].dtype == fp32[1].dtype == torch.float32


def test_peaked_regime_structure_and_loss():
    n, vocab, hidden_size = 512, 2000, 72
    hidden, classifier, labels = inputs.make_lm_head_inputs(n, vocab, hidden_size, "peaked")
    # The Zipf prior: feature 0 of C is −log(rank)/4 for a permutation of ranks, E[:, 0] = 4.
    assert torch.all(hidden[:, 0] == 4)
    ranks = torch.exp(-4 * classifier[:, 0].double()).sort().values
    assert torch.allclose(ranks, torch.arange(1, vocab + 1, dtype=torch.float64), rtol=2e-2)
    peaked = mean_cross_entropy(hidden, classifier, labels)
    flat = mean_cross_entropy(*inputs.make_lm_head_inputs(n, vocab, hidden_size, "flat"))
    log_v = math.log(vocab)
    assert peaked < 0.4 * log_v, (peaked, log_v)
    assert abs(flat - (log_v + 0.5)) < 1.0, (flat, log_v)  # logits ≈ N(0, 1)


def test_unknown_regime_rejected():
    with pytest.raises(ValueError, match="regime"):
        inputs.make_lm_head_inputs(4, 8, 2, "spiky")


def test_quick_shapes_are_small_and_keep_names():
    for shape in inputs.LM_HEAD_SHAPES.values():
        small = inputs.quick_shape(shape)
        assert small.name == shape.name
        assert small.vocab_size * small.hidden_size * 1000 < shape.vocab_size * shape.hidden_size


# ----------------------------------------------------------------------------- reference, errors


@pytest.mark.parametrize("rows_per_chunk", [1, 7, 0])
def test_reference_float64_matches_autograd(rows_per_chunk):
    hidden, classifier, labels = inputs.make_lm_head_inputs(23, 97, 16, "peaked", seed=1)
    ref = lm_head.reference_float64(hidden, classifier, labels, True, rows_per_chunk)
    e = hidden.double().requires_grad_(True)
    c = classifier.double().requires_grad_(True)
    loss = F.cross_entropy(e @ c.T, labels)
    grad_e, grad_c = torch.autograd.grad(loss, (e, c))
    assert ref.loss == pytest.approx(float(loss.detach()), rel=1e-12)
    assert torch.allclose(ref.grad_hidden, grad_e, rtol=1e-10, atol=1e-14)
    assert torch.allclose(ref.grad_classifier, grad_c, rtol=1e-10, atol=1e-14)
    no_grads = lm_head.reference_float64(hidden, classifier, labels, False)
    assert no_grads.grad_hidden is None and no_grads.loss == pytest.approx(ref.loss)


def test_relative_l2_error_chunked_equals_direct():
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(50, 9, generator=generator, dtype=torch.float64)
    actual = (reference + 1e-3 * torch.randn(50, 9, generator=generator)).to(torch.bfloat16)
    direct = float((actual.double() - reference).norm() / reference.norm())
    assert common.relative_l2_error(actual, reference, rows_per_chunk=7) == pytest.approx(direct)
    assert common.relative_l2_error(reference, reference) == 0.0
    with pytest.raises(ValueError):
        common.relative_l2_error(reference, reference[:3])


def test_case_floors_follow_design_formulas():
    case = lm_head.Case(inputs.LM_HEAD_SHAPES["gemma2-2b"], "peaked", "fwd+bwd", 8192)
    floors = case.floors_ms(723.0)
    assert floors["forward"] == pytest.approx(13.4, abs=0.05)  # docs/design.md: 9.7 TFLOP ≈ 13.4 ms
    assert floors["backward_unskipped"] == pytest.approx(3 * floors["forward"])
    assert case.floor_ms(723.0) == pytest.approx(4 * floors["forward"])


# ----------------------------------------------------------------------------- targets


def _case(shape="gemma2-2b", regime="peaked", mode="fwd+bwd"):
    return lm_head.Case(inputs.LM_HEAD_SHAPES[shape], regime, mode, 8192)


def _result(key, ms=None, mib=None, status=common.OK, err=(None, None), label=None):
    return lm_head.ProviderResult(
        key,
        label or key,
        status=status,
        ms=ms,
        peak_extra_mib=mib,
        err_hidden=err[0],
        err_classifier=err[1],
    )


def _case_result(case, *results, yardstick=(4.4e-3, 4.4e-3)):
    return lm_head.CaseResult(
        case,
        case.floors_ms(723.0),
        3.0,
        lm_head.Yardstick(*yardstick),
        {r.provider: r for r in results},
    )


def _by_description(outcomes):
    return {(o.target.provider, o.target.description): o for o in outcomes}


def test_targets_apply_per_case():
    keys = ["fusedloss", "fusedloss-exact", "torch-compile"]

    def kinds(case):
        return sorted((t.provider, t.kind, t.factor) for t in lm_head.targets_for_case(case, keys))

    assert kinds(_case()) == sorted(
        [
            ("fusedloss", "time", 0.7),
            ("fusedloss", "time", 0.35),
            ("fusedloss", "time", 0.35),
            ("fusedloss", "time", 1.0),  # filtered ≤ exact
            ("fusedloss", "memory", 0.01),
            ("fusedloss", "error", 1.0),
            ("fusedloss-exact", "memory", 0.01),
            ("fusedloss-exact", "error", 1.5),
        ]
    )
    assert ("fusedloss", "time", 1.0) in kinds(_case("phi3.5"))
    assert ("fusedloss", "time", 1.3) in kinds(_case(regime="flat"))
    forward_only = kinds(_case(mode="fwd"))
    assert ("fusedloss", "time", 1.0) in forward_only
    assert not any(kind == "error" for _, kind, _ in forward_only)
    filtered = [t for t in lm_head.targets_for_case(_case(regime="flat"), keys)
                if t.baselines == ("fusedloss-exact",)]
    assert [(t.kind, t.factor) for t in filtered] == [("time", 1.0)]
    assert not any(t.baselines == ("fusedloss-exact",) for t in lm_head.targets_for_case(
        _case(regime="flat"), ["fusedloss", "torch-compile"]))
    assert lm_head.targets_for_case(_case(), ["torch-eager"]) == []
    # the explicitly filtered provider: ≤ the exact path's time, ≤ PyTorch's own error
    with_filtered = sorted(
        (t.provider, t.kind, t.factor, t.baselines) for t in lm_head.targets_for_case(
            _case(), ["fusedloss-filtered", "fusedloss-exact", "torch-compile"]))
    assert ("fusedloss-filtered", "time", 1.0, ("fusedloss-exact",)) in with_filtered
    assert ("fusedloss-filtered", "error", 1.0, ()) in with_filtered


def test_filtered_provider_passes_the_rules_bound(monkeypatch):
    """``fusedloss-filtered`` calls with the filter rule's bound for E's dtype, ``fusedloss``
    with the API's default (exact for the LM head)."""
    calls = []
    monkeypatch.setattr(fusedloss, "linear_cross_entropy",
                        lambda e, c, y, **kw: calls.append(kw.get("filter_eps", "default")))
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    for key in ("fusedloss-filtered", "fusedloss", "fusedloss-exact"):
        providers.lm_head_providers()[key].build(torch.device("cpu"))(x, x, None)
    monkeypatch.setenv("FUSEDLOSS_FILTER_RULE", "pooled")
    providers.lm_head_providers()["fusedloss-filtered"].build(torch.device("cpu"))(x, x, None)
    assert calls == [2.0**-12, "default", None, 2.0**-10]


def test_target_checks_pass_fail_and_missing_peers():
    case_result = _case_result(
        _case(),
        _result("fusedloss", ms=30.0, mib=10.0, err=(4.0e-3, 7.0e-3)),
        _result("fusedloss-exact", ms=40.0, mib=50.0, err=(4.0e-3, 4.0e-3)),
        _result("torch-compile", ms=46.6, mib=4000.0),
        _result("cce", ms=107.7, mib=3.0),
        _result("cce-nofilter", ms=169.0, mib=1.0),
        _result("liger", status=common.NOT_INSTALLED),
    )
    outcomes = _by_description(lm_head.evaluate_targets([case_result]))
    compile_time = outcomes[("fusedloss", "time ≤ 0.7× torch.compile")]
    assert compile_time.status == common.PASS and compile_time.ratio == pytest.approx(30 / 46.6)
    cce = outcomes[("fusedloss", "time ≤ 0.35× cut-cross-entropy (faster variant)")]
    assert cce.status == common.PASS and cce.ratio == pytest.approx(30 / 107.7)
    liger = outcomes[("fusedloss", "time ≤ 0.35× liger-kernel")]
    assert liger.status == "n/a (peer not installed)"
    assert outcomes[("fusedloss", "memory ≤ 1% of torch.compile")].status == common.PASS
    assert outcomes[("fusedloss-exact", "memory ≤ 1% of torch.compile")].status == common.FAIL
    error = outcomes[("fusedloss", "gradient error ≤ 1.0× torch bf16 (dE and dC)")]
    assert error.status == common.FAIL and error.ratio == pytest.approx(7.0e-3 / 4.4e-3)
    filtered = outcomes[("fusedloss", "time ≤ 1.0× fusedloss exact (filter_eps=None)")]
    assert filtered.status == common.PASS and filtered.ratio == pytest.approx(30 / 40)
    exact = outcomes[("fusedloss-exact", "gradient error ≤ 1.5× torch bf16 (dE and dC)")]
    assert exact.status == common.PASS


def test_target_checks_when_baseline_or_ours_did_not_run():
    slow = _case_result(
        _case("phi3.5"),
        _result("fusedloss", ms=9.0, mib=1.0, err=(1e-3, 1e-3)),
        _result("torch-compile", status=common.FAILED, label="torch.compile"),
    )
    outcomes = lm_head.evaluate_targets([slow])
    assert {o.status for o in outcomes if o.target.kind != "error"} == {
        "n/a (torch.compile failed)"
    }
    broken = _case_result(
        _case(regime="flat"),
        _result("fusedloss", status=common.OUT_OF_MEMORY),
        _result("torch-compile", ms=45.0, mib=4000.0),
    )
    assert all(o.status.startswith(common.FAIL) for o in lm_head.evaluate_targets([broken]))
    no_yardstick = _case_result(
        _case(regime="flat"),
        _result("fusedloss", ms=50.0, mib=None, err=(1e-3, 1e-3)),
        _result("torch-compile", ms=45.0, mib=None),
        yardstick=(None, None),
    )
    outcomes = _by_description(lm_head.evaluate_targets([no_yardstick]))
    assert outcomes[("fusedloss", "time ≤ 1.3× torch.compile")].status == common.PASS
    assert outcomes[("fusedloss", "memory ≤ 1% of torch.compile")].status.startswith("n/a")
    error = outcomes[("fusedloss", "gradient error ≤ 1.0× torch bf16 (dE and dC)")]
    assert error.status.startswith("n/a")


# ----------------------------------------------------------------------------- providers


def test_chunked_options_prefer_automatic_chunking():
    @dataclasses.dataclass(frozen=True)
    class Options:
        batch_chunk_size: int | None = None
        chunking_method: str | None = None

    @dataclasses.dataclass(frozen=True)
    class OlderOptions:
        batch_chunk_size: int | None = None

    assert providers.chunked_options(Options).chunking_method == "auto"
    assert providers.chunked_options(OlderOptions).batch_chunk_size == 1024
    if hasattr(torch.nn, "LinearCrossEntropyOptions"):
        providers.chunked_options(torch.nn.LinearCrossEntropyOptions)  # valid with this torch


def test_missing_peer_reports_unavailable(monkeypatch):
    real_import = importlib.import_module

    def fake_import(name, *args):
        if name.startswith(("cut_cross_entropy", "liger_kernel")):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(providers.importlib, "import_module", fake_import)
    for key in ("cce", "cce-nofilter", "liger"):
        provider = providers.lm_head_providers()[key]
        assert provider.is_peer
        with pytest.raises(providers.Unavailable, match="pip install"):
            provider.build(torch.device("cpu"))


# ----------------------------------------------------------------------------- files, CLI


def test_results_files_written(tmp_path):
    case_result = _case_result(
        _case(),
        _result("fusedloss", ms=30.0, mib=1.0, err=(1e-3, 2e-3)),
        _result("torch-compile", ms=46.6, mib=4000.0),
    )
    outcomes = lm_head.evaluate_targets([case_result])
    info = lm_head.RunInfo(
        environment=common.collect_environment("cpu"),
        matmul={"size": 8192, "dtype": "bf16", "ms": 1.52, "tflops": 723.0},
        n=8192,
        dtype="bf16",
        seed=0,
        quick=False,
        timing=common.TimingSettings(),
        providers=["fusedloss", "torch-compile"],
        peer_versions={"liger-kernel": None},
        notes=["liger-kernel skipped"],
    )
    stem = common.results_stem("lm_head", "2026-11-22", "nvidia-h100-80gb-hbm3", "subset A")
    assert stem == "lm_head_2026-11-22_nvidia-h100-80gb-hbm3_subset-a"
    md_path, json_path = common.write_results(
        tmp_path / "out",
        stem,
        lm_head.render_markdown(info, [case_result], outcomes),
        lm_head.results_json(info, [case_result], outcomes),
    )
    markdown = md_path.read_text(encoding="utf-8")
    for text in ("723 TFLOP/s", "max_memory_allocated", "float64", "## Targets", "✓"):
        assert text in markdown
    data = json.loads(json_path.read_text(encoding="utf-8"))
    assert data["cases"][0]["results"][0]["ms"] == 30.0
    assert {t["status"] for t in data["targets"]} >= {common.PASS}
    assert common.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert common.json_safe({"x": [math.inf, 1.0]}) == {"x": ["inf", 1.0]}


def test_cli_rejects_unknown_names():
    with pytest.raises(SystemExit):
        run_module.main(["lm-head", "--providers", "nonsense"])
    with pytest.raises(SystemExit):
        run_module.main(["--shapes", "gpt5"])


def test_case_selection():
    assert [c.key for c in lm_head.select_cases(None, None, None, 8192, False)] == [
        " ".join(triple) for triple in lm_head.DEFAULT_CASES
    ]
    cases = lm_head.select_cases(["phi3.5"], None, ["fwd", "fwd+bwd"], 64, True)
    assert [c.key for c in cases] == ["phi3.5 peaked fwd", "phi3.5 peaked fwd+bwd"]
    assert cases[0].shape == inputs.quick_shape(inputs.LM_HEAD_SHAPES["phi3.5"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_full_size_needs_cuda(tmp_path):
    assert run_module.main(["lm-head", "--providers", "torch-eager", "--out", str(tmp_path)]) == 2


def test_quick_run_end_to_end(tmp_path, capsys):
    options = (
        "--quick --providers torch-eager --shapes phi3.5 --regimes peaked,flat "
        "--modes fwd+bwd,fwd --n 64 --matmul-size 64 --rep-ms 1 --warmup-ms 0"
    )
    code = run_module.main([*options.split(), "--out", str(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("phi3.5 flat fwd ")  # table last
    data, markdown = read_results(tmp_path, "lm_head_*")
    assert [c["case"] for c in data["cases"]] == [
        "phi3.5 peaked fwd+bwd",
        "phi3.5 peaked fwd",
        "phi3.5 flat fwd+bwd",
        "phi3.5 flat fwd",
    ]
    for case in data["cases"]:
        (eager,) = case["results"]
        assert eager["status"] == "ok" and eager["ms"] > 0
        assert eager["loss_error"] < 1e-2
        if case["mode"] == "fwd+bwd":
            assert eager["ratio_hidden"] == pytest.approx(1.0)  # the yardstick itself
            assert 0 < case["torch_bf16_error"]["dE"] < 2e-2
    assert data["cases"][0]["reference_loss"] < 0.5 * math.log(data["cases"][0]["vocab_size"])
    assert "--quick run" in markdown


@requires_cuda
def test_quick_run_times_with_do_bench_on_cuda(tmp_path):
    options = "--quick --providers torch-eager,torch-compile --shapes phi3.5"
    code = run_module.main([*options.split(), "--out", str(tmp_path)])
    assert code == 0
    data, _ = read_results(tmp_path, "lm_head_*")
    eager = data["cases"][0]["results"][0]
    assert eager["ms"] > 0 and eager["peak_extra_mib"] is not None and eager["peak_extra_mib"] > 0


def test_results_record_the_fusedloss_variables(monkeypatch):
    """A run under e.g. FUSEDLOSS_FILTER_RULE=pooled says so in its settings table."""
    for name in [k for k in os.environ if k.startswith("FUSEDLOSS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FUSEDLOSS_FILTER_RULE", "pooled")
    env = common.collect_environment("cpu")
    assert env["fusedloss_environment"] == {"FUSEDLOSS_FILTER_RULE": "pooled"}
    rows = dict(common.environment_rows(env, {}))
    assert rows["FUSEDLOSS_* variables"] == "FUSEDLOSS_FILTER_RULE=pooled"
    monkeypatch.delenv("FUSEDLOSS_FILTER_RULE")
    assert "FUSEDLOSS_* variables" not in dict(
        common.environment_rows(common.collect_environment("cpu"), {}))


@pytest.mark.skipif(not can_run_triton(), reason="needs CUDA or Triton's interpreter")
def test_check_records_the_tiles_filtering_skipped(monkeypatch):
    """The lm-head suite's check call reports the share of the backward's tiles that fusedloss's
    filter skipped (None for a provider without that backward, 0 with filtering off)."""
    from benchmarks.inputs import LMHeadShape

    # the engine's backward, which records tiles (not the gradient computed in the forward)
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "0")

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # a few column tiles hold every row's peak, the rest nothing (tiles: 16 wide under the
    # interpreter, 128 or more on a GPU)
    n, v, d = 70, 5000 if device == "cuda" else 300, 16
    hidden = (torch.randn(n, d, device=device) * 4).requires_grad_()
    classifier = (torch.randn(v, d, device=device) * 4).requires_grad_()
    labels = torch.randint(0, v, (n,), device=device)
    case = lm_head.Case(LMHeadShape("tiny", v, d), "peaked", "fwd+bwd", n)
    reference = lm_head.reference_float64(hidden, classifier, labels, True)
    skipped = {}
    for name, eps in (("exact", None), ("filtered", 0.5), ("torch", None)):
        result = lm_head.ProviderResult(name, name)
        backend = "torch" if name == "torch" else "triton"

        def forward(backend=backend, eps=eps):
            return fusedloss.linear_cross_entropy(hidden, classifier, labels, backend=backend,
                                                  filter_eps=eps)

        lm_head._check(result, forward, (hidden, classifier), case, reference,
                       lm_head.Yardstick())
        skipped[name] = result.tiles_skipped
    assert skipped["exact"] == 0.0 and skipped["torch"] is None
    assert 0.0 < skipped["filtered"] < 1.0
