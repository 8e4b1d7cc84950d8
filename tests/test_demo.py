"""The demo (``python -m fusedloss demo``) on a tiny configuration: both heads train alike."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import pytest
import torch

from fusedloss import demo
from fusedloss.__main__ import main as cli_main

TINY = demo.LM_SIZES["tiny"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_comparison() -> demo.Comparison:
    """One tiny CPU run of the LM experiment, shared by the tests below."""
    return demo.lm_experiment(TINY, torch.device("cpu"), verbose=False)


def test_source_is_deterministic_and_zipf_markov():
    source = demo.ZipfMarkovSource(vocab_size=512, support_size=8, seed=3)
    again = demo.ZipfMarkovSource(vocab_size=512, support_size=8, seed=3)
    batch = source.batch(step=5, batch_size=4, seq_len=32)
    assert batch.shape == (4, 32) and batch.dtype == torch.int64
    assert torch.equal(batch, again.batch(step=5, batch_size=4, seq_len=32))
    assert not torch.equal(batch, source.batch(step=6, batch_size=4, seq_len=32))
    # Every transition is one of the current token's successors.
    allowed = source.successors[batch[:, :-1]]  # (4, 31, K)
    assert (allowed == batch[:, 1:, None]).any(-1).all()
    assert 0 < source.optimal_loss(seq_len=32) < math.log(8)  # at most K successors


def test_both_heads_trace_the_same_curve(tiny_comparison):
    reference, candidate = tiny_comparison.reference, tiny_comparison.candidate
    assert (reference.name, candidate.name) == ("pytorch", "fusedloss")
    assert len(reference.losses) == len(candidate.losses) == TINY.steps
    assert all(math.isfinite(loss) for loss in reference.losses + candidate.losses)
    assert max(abs(d) for d in tiny_comparison.differences()) < 1e-4
    assert tiny_comparison.agrees()
    assert reference.losses[-1] < reference.losses[0] - 0.5  # it does learn
    for run in (reference, candidate):
        assert run.loss_layer_peak_bytes is not None and run.loss_layer_peak_bytes > 0
        assert run.mean_loss_layer_ms(skip=3) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_compute_the_same_loss(dtype):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=generator).to(dtype)
    weight = torch.randn(50, 16, generator=generator).to(dtype)
    tokens = torch.randint(0, 50, (2, 7), generator=generator)
    fused = demo.fusedloss_lm_head(hidden, weight, tokens)
    reference = demo.pytorch_lm_head(hidden, weight, tokens)
    assert fused.dtype == reference.dtype == torch.float32
    # bf16: PyTorch rounds the logits to bf16 before its fp32 softmax; fusedloss does not.
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused, reference, rtol=tolerance, atol=tolerance)


def test_report_writes_png(tiny_comparison, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib")
    path = demo.report(tiny_comparison, torch.device("cpu"), tmp_path, "curves.png", every=5)
    assert path == tmp_path / "curves.png"
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    out = capsys.readouterr().out
    assert f"plot written to {path}" in out
    assert "verdict: max |difference|" in out and "AGREE" in out


def test_report_without_matplotlib_skips_plot(tiny_comparison, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert demo.report(tiny_comparison, torch.device("cpu"), tmp_path, "c.png", every=5) is None
    assert not (tmp_path / "c.png").exists()
    assert "plot skipped: matplotlib is not installed" in capsys.readouterr().out


def test_command_line_runs_the_demo(tmp_path, capsys):
    cli_main(["demo", "--size", "tiny", "--device", "cpu", "--steps", "8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "pytorch" in out and "fusedloss" in out
    assert out.rstrip().splitlines()[-1].startswith("verdict:")


def test_config_from_args_applies_overrides():
    args = demo.build_parser().parse_args(
        ["--size", "large", "--steps", "7", "--dtype", "float32", "--seed", "4"]
    )
    config = demo.config_from_args(args, torch.device("cpu"))
    assert config == replace(demo.LM_SIZES["large"], steps=7, seed=4, head_dtype=torch.float32)
    auto = demo.config_from_args(demo.build_parser().parse_args([]), torch.device("cpu"))
    assert auto == demo.LM_SIZES["small"]
