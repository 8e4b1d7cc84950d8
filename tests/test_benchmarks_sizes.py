"""The sizes suite: every loss against its materialized PyTorch form, from small sizes up."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import requires_triton

from benchmarks import run as run_module
from benchmarks.suites import sizes


@pytest.mark.parametrize("name", list(sizes.LOSSES))
def test_materialized_losses_match_fusedloss(name):
    """The PyTorch forms the suite times are the losses fusedloss computes (fp32, CPU)."""
    loss = sizes.LOSSES[name]
    if loss.vocab:
        loss = sizes.Loss(loss.name, 16, vocab=50, softcap=loss.softcap)
    x = sizes.make_inputs(loss, 12, torch.float32, "cpu")
    torch.testing.assert_close(sizes.fused(loss, x), sizes.materialized(loss, x),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_quick_run_writes_every_case(tmp_path):
    assert run_module.main(["sizes", "--quick", "--losses", "clip,lm-gemma2", "--methods",
                            "fusedloss,torch", "--out", str(tmp_path), "--tag", "t"]) == 0
    (path,) = tmp_path.glob("sizes_*_t.json")
    rows = json.loads(path.read_text())["rows"]
    assert {(r["loss"], r["method"]) for r in rows} == {
        (loss, method) for loss in ("clip", "lm-gemma2") for method in ("fusedloss", "torch")}
    assert all("ms" in r and "wrong" not in r and r["host_us"] > 0 for r in rows), rows
    assert "| clip | 2 |" in next(tmp_path.glob("sizes_*_t.md")).read_text()


@pytest.mark.slow
@requires_triton
def test_tiled_and_materialized_methods_pick_their_backend(tmp_path, monkeypatch):
    """"fusedloss-tiled" asks the contrastive losses for backend="triton",
    "fusedloss-materialized" for backend="materialized" (both skip the LM head); their losses
    equal the default path's."""
    seen = []
    original = sizes.fused
    monkeypatch.setattr(sizes, "fused", lambda loss, x, backend="auto": (
        seen.append((loss.name, backend)), original(loss, x, backend))[1])
    assert run_module.main(["sizes", "--quick", "--losses", "clip,lm-llama3", "--sizes", "20",
                            "--methods", "fusedloss,fusedloss-tiled,fusedloss-materialized",
                            "--out", str(tmp_path)]) == 0
    assert ("clip", "triton") in seen and ("clip", "materialized") in seen
    assert not {("lm-llama3", "triton"), ("lm-llama3", "materialized")} & set(seen)
    rows = json.loads(next(tmp_path.glob("sizes_*.json")).read_text())["rows"]
    values = {r["method"]: r["value"] for r in rows if r["loss"] == "clip"}
    for method in ("fusedloss-tiled", "fusedloss-materialized"):
        assert abs(values["fusedloss"] - values[method]) < 1e-4 * values["fusedloss"]


def test_quick_steps_give_the_same_loss(tmp_path):
    """The tiny training steps run with both losses (eager on the CPU; on CUDA also as replayed
    graphs), which agree after the same steps (to bf16 rounding)."""
    assert run_module.main(["sizes", "--quick", "--losses", "siglip", "--methods", "torch",
                            "--steps", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("sizes_*.json")
    steps = json.loads(path.read_text())["steps"]
    for name in sizes.STEPS:
        values = [r["value"] for r in steps if r["step"] == name]
        assert len(values) in (2, 4), steps
        assert all(abs(v - values[1]) < 1e-2 * abs(values[1]) for v in values), steps


def test_plot_draws_every_method(tmp_path):
    """``--plot`` draws a line per method, every method of the suite included."""
    pytest.importorskip("matplotlib")
    rows = [dict(loss="clip", size=size, method=method, ms=1.0 + i + size / 100)
            for i, method in enumerate(sizes.METHODS) for size in (64, 128)]
    env = dict(device_name="cpu", torch=torch.__version__, triton="-", date="today")
    sizes._plot(rows, env, tmp_path / "plot.svg")
    text = (tmp_path / "plot.svg").read_text()
    assert all(method in text for method in sizes.METHODS)
