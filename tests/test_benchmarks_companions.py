"""Smoke tests of the low-precision companions suite (benchmarks/suites/companions.py) on CPU.

The helpers (cases, saved-tensor bytes, targets, the learning-rate schedule, the tower's size,
the synthetic pairs) are checked directly; the end-to-end runs use ``--quick`` (tiny shapes,
a tiny tower, 3 steps) with SwitchBack's torch backend, in a few seconds. ``do_bench`` timing,
memory figures, the host-sync check and the CUDA-graph timing need CUDA and are not exercised
here; the graphed figures' bookkeeping is, with the timing function replaced.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import import_benchmarks, read_results

common, companions, vit, run_module = import_benchmarks(
    "common", "suites.companions", "vit", "run")

CPU = torch.device("cpu")
QUICK = "companions --quick --rep-ms 1 --warmup-ms 0 --matmul-size 32"
if torch.cuda.is_available():
    QUICK += " --device cpu"


def run_quick(tmp_path, options: str = "", tag: str = "t") -> dict:
    argv = [*QUICK.split(), *options.split(), "--out", str(tmp_path), "--tag", tag]
    assert run_module.main(argv) == 0
    data, markdown = read_results(tmp_path, f"companions_*_cpu_{tag}")
    assert markdown.startswith("# Low-precision training companions")
    return data


def rows_by_provider(case: dict) -> dict[str, dict]:
    return {r["provider"]: r for r in case["results"]}


# ----------------------------------------------------------------------------- helpers


def test_cases_and_target_scope():
    cases = companions.linear_cases(companions.WIDTHS, list(companions.SHAPES),
                                    companions.TOKENS)
    assert len(cases) == 48
    assert {(c.in_features, c.out_features) for c in cases if c.width == 1664} == {
        (1664, 1664), (1664, 6656), (6656, 1664)}
    assert cases[0].key == "768x768 N8192"
    assert cases[0].flops == 6 * 8192 * 768 * 768
    in_target = [c for c in cases if c.in_target]
    assert len(in_target) == 2 * 3 * 2  # d ∈ {1280, 1664}, 3 shapes, N ∈ {32k, 64k}
    assert all(c.width >= 1280 and c.tokens >= 32768 for c in in_target)


def test_vit_b16_has_clip_image_tower_shapes():
    with torch.device("meta"):
        tower = vit.VisionTransformer(vit.VIT_B_16)
    assert vit.parameter_count(tower) == 86_192_640
    shapes = {name: tuple(p.shape) for name, p in tower.named_parameters()}
    assert shapes["patch_embed.weight"] == (768, 3, 16, 16)
    assert shapes["positional_embedding"] == (197, 768)
    assert shapes["blocks.11.attn.qkv.weight"] == (2304, 768)
    assert shapes["blocks.0.mlp.fc2.weight"] == (768, 3072)
    linears = [n for n, m in tower.named_modules() if type(m) is torch.nn.Linear]
    assert len(linears) == 12 * 4 + 1 and linears[-1] == "proj"


def test_synthetic_pairs_are_deterministic():
    def batches(seed):
        source = vit.SyntheticPairs(vit.VIT_TINY, vit.TEXT_TINY, seed, CPU)
        return [source.batch(4) for _ in range(2)]

    first, again, other = batches(1), batches(1), batches(2)
    images, texts = first[0]
    assert images.shape == (4, 3, 32, 32) and texts.shape == (4, vit.TEXT_TINY.text_dim)
    for (a, b), (c, d) in zip(first, again, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert not torch.equal(first[0][0], first[1][0])  # a new batch every step
    assert not torch.equal(first[0][0], other[0][0])


def test_saved_bytes_see_the_memory_efficient_variant():
    case = companions.LinearCase(64, "d-d", 64, 64, 256)
    inputs = companions.make_linear_inputs(case, torch.bfloat16, 0, CPU)
    saved = {}
    for provider in (companions.TORCH, companions.SWITCHBACK, companions.SWITCHBACK_M):
        layer = companions.build_layer(provider, case, inputs, "torch")
        assert torch.equal(layer.weight, inputs.weight)
        saved[provider] = companions.saved_mib(layer, inputs.x)
    x_mib = 256 * 64 * 2 / common.MIB
    assert saved[companions.TORCH] == pytest.approx(x_mib)  # x; the weight is a parameter
    assert saved[companions.SWITCHBACK] >= x_mib
    # int8 x and its row scales instead of the 16-bit x
    assert saved[companions.SWITCHBACK_M] < 0.6 * x_mib


def test_lr_schedule():
    factors = [companions.lr_factor(step, 100) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert max(factors) == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:], strict=False))


def linear_row(case, provider, ms, status="ok"):
    return companions.LinearResult(provider=provider, label=provider, status=status,
                                    case=case.key, ms=ms if status == "ok" else None)


def test_targets():
    big = companions.LinearCase(1280, "d-d", 1280, 1280, 32768)
    bigger = companions.LinearCase(1664, "d-4d", 1664, 6656, 65536)
    small = companions.LinearCase(768, "d-d", 768, 768, 65536)  # outside the scope
    case_results = []
    for case, sb_ms in ((big, 0.7), (bigger, 0.8), (small, 2.0)):
        results = {"torch": linear_row(case, "torch", 1.0),
                   "switchback": linear_row(case, "switchback", sb_ms),
                   "fp8": linear_row(case, "fp8", None, status="unavailable")}
        for result in results.values():
            if result.measured:
                result.speedup = 1.0 / result.ms
        case_results.append(companions.LinearCaseResult(case, results))
    optimizer = [
        companions.OptimizerResult(provider="stable-adamw", label="StableAdamW", ms=1.1,
                                   vs_fused=1.1, host_syncs="none"),
        companions.OptimizerResult(provider="adamw-fused", label="AdamW fused", ms=1.0,
                                   vs_fused=1.0, host_syncs="none"),
    ]
    outcomes = companions.evaluate_targets(case_results, optimizer)
    by_provider = {(o.target.provider, o.target.kind): o for o in outcomes}
    speed = by_provider[("switchback", "speed-up")]
    assert speed.status == common.FAIL  # 1/0.8 = 1.25 < 1.3 on the 1664 case
    assert speed.ratio == pytest.approx(1.25) and "1664x6656 N65536" in speed.measured
    assert "2 of 2 cases" in speed.measured  # the 768 case is outside the scope
    assert by_provider[("fp8", "speed-up")].status == "n/a (unavailable)"
    assert by_provider[("stable-adamw", "time")].status == common.PASS
    assert by_provider[("stable-adamw", "host syncs")].status == common.PASS
    optimizer[0].vs_fused, optimizer[0].host_syncs = 1.3, "synchronizes: RuntimeError: …"
    outcomes = companions.evaluate_targets([], optimizer)
    assert [o.status for o in outcomes] == [common.FAIL, common.FAIL]


def test_host_sync_check_without_cuda():
    calls = []
    assert companions.host_sync_check(lambda: calls.append(1), CPU) == "n/a (no CUDA)"
    assert not calls


# ----------------------------------------------------------------------------- end to end


def test_quick_run_end_to_end(tmp_path, capsys):
    data = run_quick(tmp_path)
    printed = capsys.readouterr().out
    assert "linear fwd+bwd" in printed and "e2e variant" in printed
    assert printed.rstrip().splitlines()[-1].split()[0] in (common.PASS, common.FAIL, "n/a")

    assert data["settings"]["parts"] == ["linear", "optimizer", "e2e"]
    assert [c["case"] for c in data["linear"]] == [
        "32x32 N64", "32x32 N128", "32x128 N64", "32x128 N128", "128x32 N64", "128x32 N128"]
    for case in data["linear"]:
        rows = rows_by_provider(case)
        assert list(rows) == list(companions.LINEAR_PROVIDERS)
        assert rows["fp8"]["status"] in ("ok", "unavailable", "failed")  # never fatal
        int8 = [rows[k] for k in ("switchback", "switchback-m", "switchback-q")]
        for row in [rows["torch"], *int8]:
            assert row["status"] == "ok", row["note"]
            assert row["ms"] > 0 and row["tflops"] > 0 and row["speedup"] > 0
            assert all(0 < row[k] < 0.05 for k in ("y_error", "dx_error", "dw_error"))
        assert rows["torch"]["speedup"] == 1.0
        # int8 is coarser than bf16 in y and dx; only SwitchBackM quantizes what dW uses
        assert all(r["y_error"] > 2 * rows["torch"]["y_error"] for r in int8)
        assert rows["switchback-m"]["dw_error"] > 2 * rows["switchback"]["dw_error"]
        assert rows["switchback-q"]["dw_error"] == pytest.approx(rows["switchback"]["dw_error"],
                                                                 rel=1e-3)
        assert rows["switchback-m"]["saved_mib"] < rows["switchback"]["saved_mib"]

    optimizer = {r["provider"]: r for r in data["optimizer"]["results"]}
    assert list(optimizer) == list(companions.OPTIMIZERS)
    assert data["optimizer"]["parameters"] == vit.parameter_count(
        vit.VisionTransformer(vit.VIT_TINY))
    for row in optimizer.values():
        assert row["status"] == "ok", row["note"]
        assert row["ms"] > 0 and row["host_syncs"] == "n/a (no CUDA)"
    assert optimizer["adamw-fused"]["vs_fused"] == 1.0

    e2e = {r["provider"]: r for r in data["e2e"]["results"]}
    assert list(e2e) == ["bf16", "switchback", "fp8"]
    assert e2e["fp8"]["status"] in ("ok", "unavailable", "failed")
    bf16, int8 = e2e["bf16"], e2e["switchback"]
    for row in (bf16, int8):
        assert row["status"] == "ok", row["note"]
        assert len(row["losses"]) == 3 and all(math.isfinite(v) for v in row["losses"])
        assert row["ms"] > 0 and len(row["step_ms"]) == 2  # 3 steps, 1 warm-up
        assert row["optimizer"] == "StableAdamW"
    assert (bf16["swapped"], int8["swapped"]) == (0, 4 * vit.VIT_TINY.layers)
    # the same initialization and batches: the first losses differ by quantization only
    assert int8["losses"][0] == pytest.approx(bf16["losses"][0], abs=0.05)
    assert bf16["losses"] != int8["losses"]
    plot = data["e2e"]["plot"]
    if plot is None:
        assert "no plot: matplotlib not installed" in data["notes"]
    else:
        assert (tmp_path / plot).exists()
    assert any(t["provider"] == "stable-adamw" for t in data["targets"])


def test_unavailable_backend_is_recorded_not_fatal(tmp_path):
    data = run_quick(tmp_path, "--parts linear,e2e --widths 16 --tokens 32 --shapes d-d "
                     "--backend no-such-backend --variants bf16,switchback")
    (case,) = data["linear"]
    rows = rows_by_provider(case)
    assert rows["torch"]["status"] == "ok"
    for key in ("switchback", "switchback-m", "switchback-q", "fp8"):
        assert rows[key]["status"] == "unavailable" and rows[key]["ms"] is None
        assert rows[key]["note"].startswith(("ValueError", "TypeError")), rows[key]["note"]
    e2e = {r["provider"]: r for r in data["e2e"]["results"]}
    assert e2e["bf16"]["status"] == "ok"
    assert e2e["switchback"]["status"] == "unavailable" and not e2e["switchback"]["losses"]
    assert any("skipped (unavailable)" in note for note in data["notes"])


@pytest.mark.parametrize(("error", "status"), [(NotImplementedError, "unavailable"),
                                               (RuntimeError, "failed")])
def test_provider_failing_when_called(tmp_path, monkeypatch, error, status):
    from fusedloss.nn import SwitchBackLinear

    def forward(self, x):
        raise error("no kernel for this shape")

    monkeypatch.setattr(SwitchBackLinear, "forward", forward)
    data = run_quick(tmp_path, "--parts linear --widths 16 --tokens 32 --shapes d-d "
                     "--providers torch,switchback")
    rows = rows_by_provider(data["linear"][0])
    assert rows["torch"]["status"] == "ok"
    assert rows["switchback"]["status"] == status
    assert rows["switchback"]["note"] == f"{error.__name__}: no kernel for this shape"


def test_options_select_what_runs(tmp_path):
    data = run_quick(tmp_path, "--parts linear --widths 16,24 --tokens 40 --shapes d-4d "
                     "--providers torch,switchback-q", tag="linear")
    assert data["optimizer"] is None and data["e2e"] is None
    assert [c["case"] for c in data["linear"]] == ["16x64 N40", "24x96 N40"]
    assert all(list(rows_by_provider(c)) == ["torch", "switchback-q"] for c in data["linear"])

    data = run_quick(tmp_path, "--parts e2e,optimizer --variants bf16 --steps 2 "
                     "--warmup-steps 0 --batch 4 --optimizer adamw", tag="e2e")
    assert data["linear"] == [] and data["settings"]["parts"] == ["optimizer", "e2e"]
    assert len(data["optimizer"]["results"]) == len(companions.OPTIMIZERS)
    (row,) = data["e2e"]["results"]
    assert row["provider"] == "bf16" and len(row["losses"]) == 2 and len(row["step_ms"]) == 2
    assert row["optimizer"] == "AdamW" and data["settings"]["train"]["optimizer"] == "adamw"
    assert data["settings"]["train"]["batch"] == 4


# ----------------------------------------------------------------------------- CUDA graphs

GRAPH_OPTIONS = "--parts linear --widths 16 --tokens 32 --shapes d-d --providers torch,switchback"


def test_graphed_figures_are_none_without_cuda(tmp_path, capsys):
    assert companions.graphed_ms(None, None, CPU, common.TimingSettings()) is None
    data = run_quick(tmp_path, GRAPH_OPTIONS)
    printed = capsys.readouterr().out
    assert data["settings"]["graphs"] is True
    assert "graphed ms" in data["definitions"] and "graphed ×" in data["definitions"]
    for row in rows_by_provider(data["linear"][0]).values():
        assert row["status"] == "ok", row["note"]
        assert row["graphed_ms"] is None and row["graphed_speedup"] is None
        assert row["speedup"] > 0  # the eager figures as before
    _, markdown = read_results(tmp_path, "companions_*_cpu_t")
    assert "| CUDA graphs (linear) | n/a (no CUDA) |" in markdown
    assert "| speed-up | graphed ms | graphed × |" in markdown
    assert "| 16x16 N32 | nn.Linear | ok |" in markdown
    line = next(ln for ln in markdown.splitlines() if ln.startswith("| 16x16 N32 | SwitchBack "))
    assert line.split(" | ")[5:7] == ["—", "—"]
    # no graphed figure taken: the printed summary keeps its eager table only
    assert "linear fwd+bwd" in printed and "graphed ×" not in printed


def test_no_graphs_skips_the_graphed_timing(tmp_path, monkeypatch):
    calls = []

    def fake_graphed_ms(layer, inputs, device, timing):
        calls.append(type(layer).__name__)

    monkeypatch.setattr(companions, "graphed_ms", fake_graphed_ms)
    data = run_quick(tmp_path, GRAPH_OPTIONS + " --no-graphs", tag="off")
    assert data["settings"]["graphs"] is False and not calls
    assert all(r["graphed_ms"] is None for r in data["linear"][0]["results"])
    run_quick(tmp_path, GRAPH_OPTIONS, tag="on")
    assert calls == ["Linear", "SwitchBackLinear"]


def test_graphed_speedup_and_tables(tmp_path, monkeypatch, capsys):
    def fake_graphed_ms(layer, inputs, device, timing):
        return 0.2 if type(layer) is torch.nn.Linear else 0.1

    monkeypatch.setattr(companions, "graphed_ms", fake_graphed_ms)
    data = run_quick(tmp_path, GRAPH_OPTIONS)
    printed = capsys.readouterr().out
    rows = rows_by_provider(data["linear"][0])
    assert rows["torch"]["graphed_ms"] == 0.2 and rows["torch"]["graphed_speedup"] == 1.0
    assert rows["switchback"]["graphed_speedup"] == pytest.approx(2.0)
    assert "SwitchBack graphed ×" in printed and "2.00×" in printed
    _, markdown = read_results(tmp_path, "companions_*_cpu_t")
    line = next(ln for ln in markdown.splitlines() if ln.startswith("| 16x16 N32 | SwitchBack "))
    assert line.split(" | ")[5:7] == ["0.10", "2.00×"]


def test_failed_capture_keeps_the_eager_figures(tmp_path, monkeypatch, capsys):
    def fake_graphed_ms(layer, inputs, device, timing):
        if type(layer) is not torch.nn.Linear:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 0.2

    monkeypatch.setattr(companions, "graphed_ms", fake_graphed_ms)
    data = run_quick(tmp_path, GRAPH_OPTIONS)
    printed = capsys.readouterr().out
    rows = rows_by_provider(data["linear"][0])
    switchback = rows["switchback"]
    assert switchback["status"] == "ok" and switchback["ms"] > 0 and switchback["speedup"] > 0
    assert switchback["graphed_ms"] is None and switchback["graphed_speedup"] is None
    problem = "not graphed: RuntimeError: operation not permitted when stream is capturing"
    assert switchback["note"] == problem
    assert f"16x16 N32: SwitchBack {problem}" in data["notes"]
    assert rows["torch"]["graphed_ms"] == 0.2 and rows["torch"]["note"] == ""
    assert "SwitchBack graphed ×" in printed and "not graphed" in printed


def test_full_size_needs_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert run_module.main(["companions"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out
