"""Smoke tests of the low-precision companions suite (benchmarks/suites/companions.py) on CPU:
the model, the synthetic pairs and the learning-rate schedule directly, the rest through
``--quick`` runs (SwitchBack's torch backend). do_bench, memory figures, host syncs and CUDA
graphs need CUDA; the graphed figures' bookkeeping is checked with the timing function replaced.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import import_benchmarks, read_results

companions, run_module = import_benchmarks("suites.companions", "run")

CPU = torch.device("cpu")
QUICK = "companions --quick --rep-ms 1 --warmup-ms 0 --device cpu"
ONE_CASE = "--parts linear --widths 16 --tokens 32"


def run_quick(tmp_path, options: str = "", tag: str = "t") -> tuple[dict, str]:
    argv = [*QUICK.split(), *options.split(), "--out", str(tmp_path), "--tag", tag]
    assert run_module.main(argv) == 0
    data, markdown = read_results(tmp_path, f"companions_*_cpu_{tag}")
    assert markdown.startswith("# Low-precision training companions")
    return data, markdown


def by_provider(rows: list[dict], case: str | None = None) -> dict[str, dict]:
    return {r["provider"]: r for r in rows if case is None or r["case"] == case}


def narrow(monkeypatch, providers=("torch", "switchback")) -> None:
    """Only the d→d shape and these linear providers run."""
    monkeypatch.setattr(companions, "SHAPES", {"d-d": (1, 1)})
    monkeypatch.setattr(companions, "LINEAR_PROVIDERS",
                        {k: companions.LINEAR_PROVIDERS[k] for k in providers})


def test_vit_b16_has_clip_image_tower_shapes():
    with torch.device("meta"):
        tower = companions.VisionTransformer(companions.VIT_B_16)
    params = dict(tower.named_parameters())
    assert len(params) == 152 and sum(p.numel() for p in params.values()) == 86_192_640
    assert params["patch_embed.weight"].shape == (768, 3, 16, 16)
    assert params["positional_embedding"].shape == (197, 768)
    assert params["blocks.11.attn.qkv.weight"].shape == (2304, 768)
    assert params["blocks.0.mlp.fc2.weight"].shape == (768, 3072)
    linears = [n for n, m in tower.named_modules() if type(m) is torch.nn.Linear]
    assert len(linears) == 12 * 4 + 1 and linears[-1] == "proj"


def test_synthetic_pairs_are_deterministic():
    def batches(seed):
        source = companions.synthetic_pairs(companions.VIT_TINY, seed, CPU, 4)
        return [next(source) for _ in range(2)]

    first, again, other = batches(1), batches(1), batches(2)
    images, texts = first[0]
    assert images.shape == (4, 3, 32, 32) and texts.shape == (4, companions.VIT_TINY.text_dim)
    for (a, b), (c, d) in zip(first, again, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert not torch.equal(first[0][0], first[1][0])  # a new batch every step
    assert not torch.equal(first[0][0], other[0][0])


def test_lr_schedule():
    factors = [companions.lr_factor(step, 100) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert max(factors) == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:], strict=False))


def test_host_syncs_without_cuda():
    calls = []
    assert companions.host_syncs(lambda: calls.append(1), CPU) == "n/a (no CUDA)"
    assert not calls


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path, capsys):
    data, markdown = run_quick(tmp_path)
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("SwitchBack fp8")  # the e2e table's last
    assert data["settings"]["parts"] == ["linear", "optimizer", "e2e"]
    cases = ["32x32 N64", "32x32 N128", "32x128 N64", "32x128 N128", "128x32 N64", "128x32 N128"]
    assert list(dict.fromkeys(r["case"] for r in data["linear"])) == cases
    for case in cases:
        rows = by_provider(data["linear"], case)
        assert list(rows) == list(companions.LINEAR_PROVIDERS)
        int8 = [rows[k] for k in ("switchback", "switchback-m", "switchback-q")]
        for row in [rows["torch"], *int8, rows["fp8"]]:
            assert row["status"] == "ok", row["note"]
            assert row["ms"] > 0 and row["speedup"] > 0 and row["graphed_ms"] is None
            assert all(0 < row[k] < 0.05 for k in ("y_error", "dx_error", "dw_error"))
        assert rows["torch"]["speedup"] == 1.0
        # int8 is coarser than bf16 in y and dx; only SwitchBackM quantizes what dW uses
        assert all(r["y_error"] > 2 * rows["torch"]["y_error"] for r in int8)
        assert rows["switchback-m"]["dw_error"] > 2 * rows["switchback"]["dw_error"]
        assert rows["switchback-q"]["dw_error"] == pytest.approx(rows["switchback"]["dw_error"],
                                                                 rel=1e-3)

    optimizer = by_provider(data["optimizer"])
    assert list(optimizer) == list(companions.OPTIMIZERS)
    for row in optimizer.values():
        assert row["status"] == "ok", row["note"]
        assert row["ms"] > 0 and row["host_syncs"] == "n/a (no CUDA)"
    assert optimizer["adamw-fused"]["vs_fused"] == 1.0
    assert "the image tower's 32 tensors" in markdown

    e2e = by_provider(data["e2e"])
    assert list(e2e) == ["torch", "switchback", "fp8"]
    for row in e2e.values():
        assert row["status"] == "ok", row["note"]
        assert len(row["losses"]) == 3 and all(math.isfinite(v) for v in row["losses"])
        assert row["ms"] > 0 and len(row["step_ms"]) == 3
        assert row["final_loss"] == pytest.approx(sum(row["losses"]) / 3)
    assert e2e["torch"]["swapped"] == 0 and e2e["fp8"]["swapped"] == 4 * 2  # 4 per block
    # the same initialization and batches: the first losses differ by quantization only
    assert e2e["switchback"]["losses"][0] == pytest.approx(e2e["torch"]["losses"][0], abs=0.05)
    assert e2e["switchback"]["losses"] != e2e["torch"]["losses"]
    assert e2e["fp8"]["final_loss_delta"] == pytest.approx(
        e2e["fp8"]["final_loss"] - e2e["torch"]["final_loss"])
    assert len(list(tmp_path.glob("companions_*_cpu_t.png"))) == 1 or "no plot" in printed


def test_unavailable_option_is_recorded_not_fatal(tmp_path, monkeypatch):
    narrow(monkeypatch, providers=("torch", "switchback", "fp8"))
    companions.LINEAR_PROVIDERS["switchback"] = ("SwitchBack", {"no_such_option": True})
    data, _ = run_quick(tmp_path, "--parts linear,e2e --widths 16 --tokens 32")
    rows = by_provider(data["linear"])
    assert rows["torch"]["status"] == rows["fp8"]["status"] == "ok"
    assert rows["switchback"]["status"] == "unavailable" and rows["switchback"]["ms"] is None
    assert rows["switchback"]["note"].startswith("TypeError: unknown SwitchBackLinear option")
    e2e = by_provider(data["e2e"])
    assert e2e["torch"]["status"] == "ok"
    assert e2e["switchback"]["status"] == "unavailable" and not e2e["switchback"]["losses"]


@pytest.mark.parametrize(("error", "status"), [(NotImplementedError, "unavailable"),
                                               (RuntimeError, "failed")])
def test_provider_failing_when_called(tmp_path, monkeypatch, error, status):
    from fusedloss.nn import SwitchBackLinear

    def forward(self, x):
        raise error("no kernel for this shape")

    monkeypatch.setattr(SwitchBackLinear, "forward", forward)
    narrow(monkeypatch)
    data, markdown = run_quick(tmp_path, ONE_CASE)
    rows = by_provider(data["linear"])
    assert rows["torch"]["status"] == "ok"
    assert rows["switchback"]["status"] == status
    assert rows["switchback"]["note"] == f"{error.__name__}: no kernel for this shape"
    assert f"| 16x16 N32 | SwitchBack | {status} |" in markdown  # the status in the ms column


@pytest.mark.slow
def test_options_select_what_runs(tmp_path, monkeypatch):
    data, _ = run_quick(tmp_path, "--parts e2e,optimizer --steps 2", tag="e2e")
    assert "linear" not in data and data["settings"]["parts"] == ["optimizer", "e2e"]
    assert len(data["optimizer"]) == len(companions.OPTIMIZERS)
    assert [len(r["losses"]) for r in data["e2e"]] == [2, 2, 2]
    assert data["settings"]["batch"] == companions.QUICK["batch"]

    narrow(monkeypatch, providers=("torch", "switchback-q"))
    monkeypatch.setattr(companions, "SHAPES", {"d-4d": (1, 4)})
    data, _ = run_quick(tmp_path, "--parts linear --widths 16,24 --tokens 40", tag="linear")
    assert "optimizer" not in data and "e2e" not in data
    assert [r["case"] for r in data["linear"]] == ["16x64 N40"] * 2 + ["24x96 N40"] * 2
    assert [r["provider"] for r in data["linear"]] == ["torch", "switchback-q"] * 2


def test_graphed_speedups(tmp_path, monkeypatch, capsys):
    narrow(monkeypatch)
    assert companions.graphed_ms(None, CPU, companions.TRITON_TIMING) is None
    calls = []

    def fake_graphed_ms(step, device, timing):
        calls.append(step)
        return 0.2 if len(calls) == 1 else 0.1  # nn.Linear first

    monkeypatch.setattr(companions, "graphed_ms", fake_graphed_ms)
    data, markdown = run_quick(tmp_path, ONE_CASE)
    rows = by_provider(data["linear"])
    assert len(calls) == 2
    assert rows["torch"]["graphed_ms"] == 0.2 and rows["torch"]["graphed_speedup"] == 1.0
    assert rows["switchback"]["graphed_speedup"] == pytest.approx(2.0)
    line = next(ln for ln in markdown.splitlines() if ln.startswith("| 16x16 N32 | SwitchBack "))
    assert line.split(" | ")[4:6] == ["0.10", "2.00×"]
    assert "2.00×" in capsys.readouterr().out


def test_failed_capture_keeps_the_eager_figures(tmp_path, monkeypatch):
    narrow(monkeypatch)

    def fake_graphed_ms(step, device, timing):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(companions, "graphed_ms", fake_graphed_ms)
    data, _ = run_quick(tmp_path, ONE_CASE)
    for row in data["linear"]:
        assert row["status"] == "failed" and row["graphed_ms"] is None
        assert row["note"] == "RuntimeError: operation not permitted when stream is capturing"
        assert row["ms"] > 0 and row["y_error"] < 0.05 and row["speedup"] > 0


def test_full_size_needs_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert run_module.main(["companions"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out
