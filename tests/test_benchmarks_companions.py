"""Smoke tests of the low-precision companions suite (benchmarks/suites/companions.py) on CPU.

The helpers (cases, saved-tensor bytes, the learning-rate schedule, the tower's size, the
synthetic pairs) are checked directly; the end-to-end runs use ``--quick`` (tiny shapes, a tiny
tower, 3 steps) with SwitchBack's torch backend, in a few seconds; tests that need fewer linear
cases narrow the suite's ``SHAPES`` and ``LINEAR_PROVIDERS``. ``do_bench`` timing,
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


def narrow_linear(monkeypatch, shapes=("d-d",), providers=("torch", "switchback")) -> None:
    """Only these linear shapes and providers run."""
    monkeypatch.setattr(companions, "SHAPES", {k: companions.SHAPES[k] for k in shapes})
    monkeypatch.setattr(companions, "LINEAR_PROVIDERS", tuple(providers))


# ----------------------------------------------------------------------------- helpers


def test_cases():
    cases = companions.linear_cases(companions.WIDTHS, list(companions.SHAPES),
                                    companions.TOKENS)
    assert len(cases) == 48
    assert {(c.in_features, c.out_features) for c in cases if c.width == 1664} == {
        (1664, 1664), (1664, 6656), (6656, 1664)}
    assert cases[0].key == "768x768 N8192"
    assert cases[0].flops == 6 * 8192 * 768 * 768


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


def test_host_sync_check_without_cuda():
    calls = []
    assert companions.host_sync_check(lambda: calls.append(1), CPU) == "n/a (no CUDA)"
    assert not calls


# ----------------------------------------------------------------------------- end to end


def test_quick_run_end_to_end(tmp_path, capsys):
    data = run_quick(tmp_path)
    printed = capsys.readouterr().out
    assert "linear fwd+bwd" in printed and "e2e variant" in printed
    assert printed.rstrip().splitlines()[-1].startswith("SwitchBack fp8")  # the e2e table's last

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
    assert "targets" not in data


def test_unavailable_backend_is_recorded_not_fatal(tmp_path, monkeypatch):
    narrow_linear(monkeypatch, providers=companions.LINEAR_PROVIDERS)
    monkeypatch.setattr(companions, "switchback_backend", lambda device: "no-such-backend")
    data = run_quick(tmp_path, "--parts linear,e2e --widths 16 --tokens 32")
    assert data["settings"]["backend"] == "no-such-backend"
    (case,) = data["linear"]
    rows = rows_by_provider(case)
    assert rows["torch"]["status"] == "ok"
    for key in ("switchback", "switchback-m", "switchback-q", "fp8"):
        assert rows[key]["status"] == "unavailable" and rows[key]["ms"] is None
        assert rows[key]["note"].startswith(("ValueError", "TypeError")), rows[key]["note"]
    e2e = {r["provider"]: r for r in data["e2e"]["results"]}
    assert e2e["bf16"]["status"] == "ok"
    for key in ("switchback", "fp8"):
        assert e2e[key]["status"] == "unavailable" and not e2e[key]["losses"]
    assert any("skipped (unavailable)" in note for note in data["notes"])


@pytest.mark.parametrize(("error", "status"), [(NotImplementedError, "unavailable"),
                                               (RuntimeError, "failed")])
def test_provider_failing_when_called(tmp_path, monkeypatch, error, status):
    from fusedloss.nn import SwitchBackLinear

    def forward(self, x):
        raise error("no kernel for this shape")

    monkeypatch.setattr(SwitchBackLinear, "forward", forward)
    narrow_linear(monkeypatch)
    data = run_quick(tmp_path, "--parts linear --widths 16 --tokens 32")
    rows = rows_by_provider(data["linear"][0])
    assert rows["torch"]["status"] == "ok"
    assert rows["switchback"]["status"] == status
    assert rows["switchback"]["note"] == f"{error.__name__}: no kernel for this shape"


def test_options_select_what_runs(tmp_path, monkeypatch):
    narrow_linear(monkeypatch, shapes=("d-4d",), providers=("torch", "switchback-q"))
    data = run_quick(tmp_path, "--parts linear --widths 16,24 --tokens 40", tag="linear")
    assert data["optimizer"] is None and data["e2e"] is None
    assert [c["case"] for c in data["linear"]] == ["16x64 N40", "24x96 N40"]
    assert all(list(rows_by_provider(c)) == ["torch", "switchback-q"] for c in data["linear"])

    data = run_quick(tmp_path, "--parts e2e,optimizer --steps 2", tag="e2e")
    assert data["linear"] == [] and data["settings"]["parts"] == ["optimizer", "e2e"]
    assert len(data["optimizer"]["results"]) == len(companions.OPTIMIZERS)
    rows = data["e2e"]["results"]
    assert [r["provider"] for r in rows] == list(companions.VARIANTS)
    row = rows[0]  # nn.Linear; 2 steps, the first a warm-up step
    assert row["provider"] == "bf16" and len(row["losses"]) == 2 and len(row["step_ms"]) == 1
    assert row["optimizer"] == "StableAdamW"
    assert data["settings"]["train"]["batch"] == companions.QUICK_BATCH


# ----------------------------------------------------------------------------- CUDA graphs

GRAPH_OPTIONS = "--parts linear --widths 16 --tokens 32"


@pytest.fixture
def graph_case(monkeypatch):
    """One case (16x16 N32), nn.Linear and SwitchBack."""
    narrow_linear(monkeypatch)


def test_graphed_figures_are_none_without_cuda(tmp_path, capsys, graph_case):
    assert companions.graphed_ms(None, None, CPU, common.TimingSettings()) is None
    data = run_quick(tmp_path, GRAPH_OPTIONS)
    printed = capsys.readouterr().out
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


def test_every_measured_provider_is_graphed(tmp_path, monkeypatch, graph_case):
    calls = []

    def fake_graphed_ms(layer, inputs, device, timing):
        calls.append(type(layer).__name__)

    monkeypatch.setattr(companions, "graphed_ms", fake_graphed_ms)
    data = run_quick(tmp_path, GRAPH_OPTIONS)
    assert calls == ["Linear", "SwitchBackLinear"]
    assert all(r["graphed_ms"] is None for r in data["linear"][0]["results"])


def test_graphed_speedup_and_tables(tmp_path, monkeypatch, capsys, graph_case):
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


def test_failed_capture_keeps_the_eager_figures(tmp_path, monkeypatch, capsys, graph_case):
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
