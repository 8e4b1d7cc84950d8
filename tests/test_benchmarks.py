"""Smoke tests of the benchmark runner's logic (benchmarks/): no CUDA needed, a few seconds.

Inputs, the float64 reference, the providers and the results files are checked on CPU; the
end-to-end run uses ``--quick`` with torch eager only. Timing through
``triton.testing.do_bench`` and memory figures need CUDA and are tested only there.
"""

from __future__ import annotations

import importlib
import json
import math
from types import SimpleNamespace

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


@pytest.mark.parametrize(("rows_per_chunk", "softcap"), [(1, None), (7, None), (0, None), (7, 3.0)])
def test_reference_float64_matches_autograd(rows_per_chunk, softcap):
    hidden, classifier, labels = inputs.make_lm_head_inputs(23, 97, 16, "peaked", seed=1)
    ref = lm_head.reference_float64(hidden, classifier, labels, True, rows_per_chunk, softcap)
    e = hidden.double().requires_grad_(True)
    c = classifier.double().requires_grad_(True)
    logits = e @ c.T
    loss = F.cross_entropy(logits if softcap is None else softcap * torch.tanh(logits / softcap),
                           labels)
    grad_e, grad_c = torch.autograd.grad(loss, (e, c))
    assert ref.loss == pytest.approx(float(loss.detach()), rel=1e-12)
    assert torch.allclose(ref.grad_hidden, grad_e, rtol=1e-10, atol=1e-14)
    assert torch.allclose(ref.grad_classifier, grad_c, rtol=1e-10, atol=1e-14)
    no_grads = lm_head.reference_float64(hidden, classifier, labels, False, softcap=softcap)
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
    forward = _case(mode="fwd").floor_ms(723.0)
    assert forward == pytest.approx(13.4, abs=0.05)  # docs/design.md: 9.7 TFLOP ≈ 13.4 ms
    assert _case().floor_ms(723.0) == pytest.approx(4 * forward)  # 8NVD/R: nothing skipped


@pytest.mark.parametrize("rows_per_chunk", [None, 5])
def test_products_yardstick_runs_whole_or_in_chunks(rows_per_chunk):
    hidden, classifier, _ = inputs.make_lm_head_inputs(23, 97, 16, "flat")
    timing = common.TimingSettings(warmup_ms=0.0, rep_ms=1.0)
    for with_backward in (True, False):
        products = common.time_products(hidden, classifier, timing, backward=with_backward,
                                        logit_products=2, rows_per_chunk=rows_per_chunk)
        assert products["ms"] > 0 and not products["note"]
        assert products["method"] == ("whole" if rows_per_chunk is None else "5 chunks of 5 rows")
        assert products["rows_per_chunk"] == (23 if rows_per_chunk is None else 5)


# ----------------------------------------------------------------------------- results


def _case(shape="gemma2-2b", regime="peaked", mode="fwd+bwd"):
    return lm_head.Case(inputs.LM_HEAD_SHAPES[shape], regime, mode, 8192)


def _result(key, ms=None, mib=None, status=common.OK, err=(None, None), label=None):
    return common.new_row(key, label or key, **{
        **dict.fromkeys(lm_head.FIGURES), "status": status, "ms": ms, "peak_extra_mib": mib,
        "err_hidden": err[0], "err_classifier": err[1]})


def _case_result(case, *results, products_ms=20.0):
    products = {"ms": products_ms, "rows_per_chunk": case.n, "method": "whole", "note": ""}
    yardstick = {"dE": 4.4e-3, "dC": 4.4e-3, "note": ""}
    return lm_head.CaseResult(case, case.floor_ms(723.0), 3.0, yardstick, products,
                              {r["provider"]: r for r in results})


# ----------------------------------------------------------------------------- providers


def test_fusedloss_providers_pass_filter_eps(monkeypatch):
    """``fusedloss`` calls with the API's default (exact for the LM head), ``fusedloss-exact``
    with an explicit ``filter_eps=None``."""
    calls = []
    monkeypatch.setattr(fusedloss, "linear_cross_entropy",
                        lambda e, c, y, **kw: calls.append(kw.get("filter_eps", "default")))
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    for key in ("fusedloss", "fusedloss-exact"):
        providers.lm_head_providers()[key].build(torch.device("cpu"))(x, x, None)
    assert calls == ["default", None]


def test_missing_peer_reports_unavailable(monkeypatch):
    real_import = importlib.import_module

    def fake_import(name, *args):
        if name.startswith(("cut_cross_entropy", "liger_kernel")):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(providers.importlib, "import_module", fake_import)
    for key in ("cce", "liger"):
        provider = providers.lm_head_providers()[key]
        assert provider.is_peer
        with pytest.raises(providers.Unavailable, match="pip install"):
            provider.build(torch.device("cpu"))


def test_every_provider_applies_the_heads_softcap(monkeypatch):
    """Each provider's build passes the shape's soft-cap on (fakes stand in for fusedloss and the
    peers; torch's own providers are compared with the float64 reference)."""
    seen = []

    def record(name, softcap):
        seen.append((name, softcap))
        return torch.zeros(())

    class FakeLiger:
        def __init__(self, reduction, softcap):
            record("liger", softcap)

        def __call__(self, c, e, y):
            return torch.zeros(())

    fakes = {
        "cut_cross_entropy": SimpleNamespace(
            linear_cross_entropy=lambda e, c, y, softcap=None, filter_eps="high": record(
                "cce", softcap)),
        "liger_kernel.transformers.fused_linear_cross_entropy": SimpleNamespace(
            LigerFusedLinearCrossEntropyLoss=FakeLiger),
    }
    real_import = importlib.import_module
    monkeypatch.setattr(providers.importlib, "import_module",
                        lambda name, *args: fakes.get(name) or real_import(name, *args))
    monkeypatch.setattr(fusedloss, "linear_cross_entropy",
                        lambda e, c, y, softcap=None, **kw: record("fusedloss", softcap))
    monkeypatch.setattr(torch, "compile", lambda function, **kw: function)

    shape = inputs.quick_shape(inputs.LM_HEAD_SHAPES["gemma2-2b"])
    assert shape.softcap == 30.0 and inputs.LM_HEAD_SHAPES["llama3-8b"].softcap is None
    hidden, classifier, labels = inputs.make_lm_head_inputs(
        32, shape.vocab_size, shape.hidden_size, "peaked")
    capped = lm_head.reference_float64(hidden, classifier, labels, False, softcap=30.0).loss
    plain = lm_head.reference_float64(hidden, classifier, labels, False).loss
    assert abs(capped - plain) > 5e-3
    assert list(providers.lm_head_providers()) == [
        "fusedloss", "fusedloss-exact", "fusedloss-compile", "torch-eager", "torch-compile", "cce",
        "liger"]
    for key, provider in providers.lm_head_providers().items():
        loss = float(provider.build(torch.device("cpu"), 30.0)(hidden, classifier, labels))
        if key.startswith("torch"):
            assert loss == pytest.approx(capped, abs=1e-3), key
    assert sorted(seen) == sorted([("fusedloss", 30.0)] * 3 + [("cce", 30.0), ("liger", 30.0)])


# ----------------------------------------------------------------------------- files, CLI


def _run_info(n=(8192,), providers_run=("fusedloss", "torch-compile")):
    settings = {"n": list(n), "dtype": "bf16", "seed": 0, "quick": False, "warmup_ms": 100.0,
                "rep_ms": 1000.0, "providers": list(providers_run)}
    return {"suite": "lm-head", "environment": common.collect_environment("cpu"),
            "settings": settings, "matmul": {"size": 8192, "dtype": "bf16", "ms": 1.52,
                                             "tflops": 723.0},
            "notes": ["liger-kernel skipped"], "peer_versions": {"liger-kernel": None},
            "calls": {"fusedloss": "fusedloss.linear_cross_entropy(E, C, y)"}}


def test_results_files_written(tmp_path):
    case_result = _case_result(
        _case(),
        _result("fusedloss", ms=30.0, mib=1.0, err=(1e-3, 2e-3)),
        _result("torch-compile", ms=46.6, mib=4000.0),
    )
    case_result.results["fusedloss"].update(times_products=1.5, tiles_skipped=0.25)
    info = _run_info()
    stem = common.results_stem("lm_head", "2026-11-22", "nvidia-h100-80gb-hbm3", "subset A")
    assert stem == "lm_head_2026-11-22_nvidia-h100-80gb-hbm3_subset-a"
    md_path, json_path = common.write_report(
        tmp_path / "out", "lm_head", "subset A", info["environment"], "LM head",
        *lm_head.report_sections(info, [case_result]), lm_head.results_json(info, [case_result]),
        "", calls=info["calls"], notes=info["notes"], log=lambda _line: None)
    markdown = md_path.read_text(encoding="utf-8")
    for text in ("723 TFLOP/s", "benchmarks/README.md", "torch bf16 dE / dC", "4.4e-03 / 4.4e-03",
                 "| 3.00000 |", "1.0e-03", "2.0e-03", "| 20.0 |", "softcap 30", "25.00%",
                 "| 30.0 / 1.0 (1.50×) |", "fwd+bwd: products", "## Calls measured",
                 "- liger-kernel skipped"):
        assert text in markdown, text
    data = json.loads(json_path.read_text(encoding="utf-8"))
    assert data["cases"][0]["results"][0]["ms"] == 30.0
    assert data["cases"][0]["products"]["ms"] == 20.0 and data["cases"][0]["softcap"] == 30.0
    assert data["cases"][0]["results"][0]["times_products"] == 1.5
    assert data["cases"][0]["torch_bf16_error"] == {"dE": 4.4e-3, "dC": 4.4e-3, "note": ""}
    assert data["cases"][0]["products"] == {"ms": 20.0, "rows_per_chunk": 8192,
                                            "method": "whole", "note": ""}
    assert data["settings"]["n"] == [8192] and data["suite"] == "lm-head"
    assert common.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert common.json_safe({"x": [math.inf, 1.0]}) == {"x": ["inf", 1.0]}


def test_plot_script_draws_the_suites_results(tmp_path):
    """``python benchmarks/run.py lm-head --plot RESULTS.json --out F.svg`` on results in the
    suite's format: one panel per head and mode, the products floor, the run in the title."""
    pytest.importorskip("matplotlib")
    (run,) = import_benchmarks("run")
    case_results = []
    for shape in ("llama3-1b", "gemma2-2b"):
        for mode in lm_head.MODES:
            for n in (4096, 16384, 65536):
                ms = n / 1000
                case_result = _case_result(
                    lm_head.Case(inputs.LM_HEAD_SHAPES[shape], "flat", mode, n),
                    _result("fusedloss", ms=ms, mib=1.0), _result("torch-compile", ms=2 * ms),
                    _result("liger", status=common.NOT_INSTALLED), products_ms=0.8 * ms)
                case_results.append(case_result)
    payload = common.json_safe(lm_head.results_json(_run_info(n=(4096, 16384, 65536)),
                                                    case_results))
    results = tmp_path / "lm_head.json"
    results.write_text(json.dumps(payload), encoding="utf-8")
    out = tmp_path / "docs" / "speed.svg"
    assert run.main(["lm-head", "--plot", str(results), "--out", str(out)]) == 0
    svg = out.read_text(encoding="utf-8")
    assert svg.lstrip().startswith("<?xml") and "</svg>" in svg
    for text in ("gemma2-2b (V 256000, D 2304, softcap 30)", "forward only", "torch-compile",
                 "products", "CPU"):
        assert text in svg, text
    assert "liger" not in svg  # not installed: no line, no legend entry


def test_cli_rejects_unknown_names():
    with pytest.raises(SystemExit):
        run_module.main(["lm-head", "--providers", "nonsense"])
    with pytest.raises(SystemExit):
        run_module.main(["--shapes", "gpt5"])


def test_case_selection():
    default = lm_head.select_cases(None, None, None, [8192], False)
    assert sorted(c.key for c in default) == sorted(
        f"{shape} {regime} N=8192 {mode}" for shape, regime, mode in lm_head.DEFAULT_CASES)
    cases = lm_head.select_cases(["phi3.5"], None, ["fwd", "fwd+bwd"], [64], True)
    assert [c.key for c in cases] == ["phi3.5 peaked N=64 fwd", "phi3.5 peaked N=64 fwd+bwd"]
    assert cases[0].shape == inputs.quick_shape(inputs.LM_HEAD_SHAPES["phi3.5"])


def test_n_list_gives_a_case_per_token_count():
    parser = run_module.build_parser()
    args = parser.parse_args(["lm-head", "--shapes", "llama3-1b,qwen2.5-7b", "--modes",
                              "fwd+bwd,fwd", "--n", "4096,16384,65536,4096"])
    assert args.n == [4096, 16384, 65536]
    cases = lm_head.select_cases(args.shapes, args.regimes, args.modes, args.n, False)
    assert len(cases) == 2 * 2 * 3 == len({c.key for c in cases})
    assert [c.key for c in cases[:3]] == [
        "llama3-1b peaked N=4096 fwd+bwd", "llama3-1b peaked N=4096 fwd",
        "llama3-1b peaked N=16384 fwd+bwd"]
    assert cases[-1].shape == inputs.LMHeadShape("qwen2.5-7b", 151_936, 3584)
    assert parser.parse_args(["lm-head", "--n", "8192"]).n == [8192]
    for bad in ("0", "4k", ",", "4096,-1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["lm-head", "--n", bad])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_full_size_needs_cuda(tmp_path):
    assert run_module.main(["lm-head", "--providers", "torch-eager", "--out", str(tmp_path)]) == 2


def test_quick_run_end_to_end(tmp_path, capsys):
    options = (
        "--quick --providers torch-eager --shapes phi3.5 --regimes peaked,flat "
        "--modes fwd+bwd,fwd --n 64 --rep-ms 1 --warmup-ms 0"
    )
    code = run_module.main([*options.split(), "--out", str(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("phi3.5 flat N=64 fwd ")  # table last
    data, markdown = read_results(tmp_path, "lm_head_*")
    assert [c["case"] for c in data["cases"]] == [
        "phi3.5 peaked N=64 fwd+bwd", "phi3.5 peaked N=64 fwd",
        "phi3.5 flat N=64 fwd+bwd", "phi3.5 flat N=64 fwd",
    ]
    for case in data["cases"]:
        (eager,) = case["results"]
        assert eager["status"] == "ok" and eager["ms"] > 0
        assert eager["loss_error"] < 1e-2
        assert case["products"]["ms"] > 0 and case["products"]["method"] == "whole"
        assert eager["times_products"] == pytest.approx(eager["ms"] / case["products"]["ms"])
        if case["mode"] == "fwd+bwd":
            assert eager["ratio_hidden"] == pytest.approx(1.0)  # the yardstick itself
            assert 0 < case["torch_bf16_error"]["dE"] < 2e-2
    assert data["cases"][0]["reference_loss"] < 0.5 * math.log(data["cases"][0]["vocab_size"])
    assert "--quick: shrunk shapes" in markdown


def test_quick_run_at_several_n_applies_the_softcap(tmp_path):
    """A case per N; gemma2-2b's soft-cap reaches the suite's float64 reference and torch eager."""
    options = ("--quick --providers torch-eager --shapes gemma2-2b --modes fwd --n 32,16 "
               "--rep-ms 1 --warmup-ms 0")
    assert run_module.main([*options.split(), "--out", str(tmp_path)]) == 0
    data, _ = read_results(tmp_path, "lm_head_*")
    assert data["settings"]["n"] == [32, 16]
    assert [c["case"] for c in data["cases"]] == ["gemma2-2b peaked N=32 fwd",
                                                  "gemma2-2b peaked N=16 fwd"]
    case = data["cases"][0]
    (eager,) = case["results"]
    assert case["softcap"] == 30.0 and eager["status"] == "ok"
    assert eager["loss"] == pytest.approx(case["reference_loss"], abs=1e-3)
    plain = lm_head.reference_float64(*inputs.make_lm_head_inputs(
        32, case["vocab_size"], case["hidden_size"], "peaked"), False).loss
    assert abs(eager["loss"] - plain) > 5e-3


@requires_cuda
def test_quick_run_times_with_do_bench_on_cuda(tmp_path):
    options = "--quick --providers torch-eager,torch-compile --shapes phi3.5"
    code = run_module.main([*options.split(), "--out", str(tmp_path)])
    assert code == 0
    data, _ = read_results(tmp_path, "lm_head_*")
    eager = data["cases"][0]["results"][0]
    assert eager["ms"] > 0 and eager["peak_extra_mib"] is not None and eager["peak_extra_mib"] > 0


def test_results_record_the_fusedloss_tuning(tune):
    """A run under a changed tuning (e.g. FUSEDLOSS_SCRATCH_MB=32) says so in its settings
    table; the defaults say nothing."""
    assert "fusedloss tuning" not in dict(
        common.environment_rows(common.collect_environment("cpu"), {}))
    tune(scratch_mb=32.0)
    env = common.collect_environment("cpu")
    assert env["fusedloss_environment"] == {"scratch_mb": "32.0"}
    rows = dict(common.environment_rows(env, {}))
    assert rows["fusedloss tuning"] == "scratch_mb=32.0"


@pytest.mark.slow
@pytest.mark.skipif(not can_run_triton(), reason="needs CUDA or Triton's interpreter")
def test_check_records_the_tiles_filtering_skipped():
    """The lm-head suite's check call records the share of the backward's tiles that fusedloss's
    filter skipped (None for a provider without that backward, 0 with filtering off)."""
    from benchmarks.inputs import LMHeadShape

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # a few column tiles hold every row's peak, the rest nothing (tiles: 16 wide under the
    # interpreter, 128 or more on a GPU)
    n, v, d = 70, 5000 if device == "cuda" else 300, 16
    strong = v // 8  # the classes that can win: every row's peak lies in the first columns
    hidden = (torch.randn(n, d, device=device) * 4).requires_grad_()
    classifier = torch.randn(v, d, device=device) * 4
    classifier[strong:] *= 0.01
    classifier.requires_grad_()
    labels = torch.randint(0, strong, (n,), device=device)
    case_result = _case_result(lm_head.Case(LMHeadShape("tiny", v, d), "peaked", "fwd+bwd", n))
    reference = lm_head.reference_float64(hidden, classifier, labels, True)
    timing = common.TimingSettings(warmup_ms=0.0, rep_ms=1.0)
    skipped = {}
    for name, eps in (("exact", None), ("filtered", 0.5), ("torch", None)):
        backend = "torch" if name == "torch" else "triton"

        def build(provider, device, softcap, backend=backend, eps=eps):
            # per-token losses, then the mean: the engine's backward, which records tiles (a
            # reduced loss takes the training path, which filters nothing)
            return lambda e, c, y: fusedloss.linear_cross_entropy(
                e, c, y, backend=backend, filter_eps=eps, reduction="none").mean()

        result = lm_head.run_provider(providers.Provider(name, name, build), case_result,
                                      (hidden, classifier, labels), reference, timing)
        assert result["status"] == common.OK and result["err_hidden"] < 0.05, result
        skipped[name] = result["tiles_skipped"]
    assert skipped["exact"] == 0.0 and skipped["torch"] is None
    assert 0.0 < skipped["filtered"] < 1.0
