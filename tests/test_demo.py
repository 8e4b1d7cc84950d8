"""examples/demo.py (``make demo``), loaded from its path: on the tiny sizes both experiments
train twice and the curves agree, the report prints the verdicts and writes the plots; the
verdict logic; the script as ``make demo`` runs it; and at the CPU size, fusedloss's LM step
peaks at well under half of PyTorch's memory (the claim of the README)."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fusedloss

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPERIMENTS = ["lm", "clip"]


def load_example():
    spec = importlib.util.spec_from_file_location("fusedloss_demo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


demo = load_example()


def has_matplotlib() -> bool:
    try:
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """``main`` on the tiny sizes: (comparisons, printed output, output folder)."""
    out = tmp_path_factory.mktemp("demo_out")
    threads, printed = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            comparisons = demo.main(["--size", "tiny", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # main sets one thread on the CPU
    return comparisons, printed.getvalue(), out


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_both_runs_trace_the_same_curve(tiny_run, experiment):
    comparisons, _, _ = tiny_run
    assert list(comparisons) == EXPERIMENTS
    comparison = comparisons[experiment]
    reference, candidate = comparison.reference, comparison.candidate
    assert (reference.name, candidate.name) == ("pytorch", "fusedloss")
    steps = demo.SIZES["tiny"][experiment]["steps"]
    assert len(reference.losses) == len(candidate.losses) == steps
    assert all(math.isfinite(loss) for loss in reference.losses + candidate.losses)
    assert max(abs(d) for d in comparison.differences()) < 1e-4
    assert comparison.agrees() and comparison.tolerance == 1e-2  # tiny trains in float32
    assert reference.losses[-1] < reference.losses[0] - 0.5  # it does learn
    # lm: the loss is inside the Hugging Face model's forward, so the whole step is measured.
    assert comparison.measured == {"lm": "training step", "clip": "loss layer"}[experiment]
    for run in (reference, candidate):
        assert run.peak_bytes is not None and run.peak_bytes > 0
        assert len(run.seconds) == steps - 1 and run.mean_ms() > 0  # one step measures memory


def test_learned_logit_scales_agree(tiny_run):
    note = tiny_run[0]["clip"].notes[0]
    scales = re.fullmatch(r"learned logit_scale after \d+ steps: pytorch ([\d.]+), "
                          r"fusedloss ([\d.]+) \(init 14\.286\)", note).groups()
    assert scales[0] == scales[1] and scales[0] != "14.286"  # the same, and learned


def test_report_prints_verdicts_and_writes_plots(tiny_run):
    _, printed, out = tiny_run
    assert "causal LM" in printed and "CLIP-style two towers" in printed
    verdicts = [line for line in printed.splitlines() if line.startswith("verdict:")]
    assert len(verdicts) == 2 and all("AGREE within 0.01 nats" in v for v in verdicts)
    assert printed.rstrip().splitlines()[-1] == verdicts[-1]
    for measured in ("training step", "loss layer"):
        assert f"{measured} peak memory" in printed and f"{measured} time" in printed
    if not has_matplotlib():  # the test extra has none: the plots are skipped, not an error
        assert printed.count("plot skipped: matplotlib is not installed") == 2
        return
    plots = sorted(out.iterdir())
    assert [p.name for p in plots] == ["clip_loss_curves.png", "lm_loss_curves.png"]
    for path in plots:
        assert path.read_bytes().startswith(PNG_SIGNATURE)
        assert f"plot written to {path}" in printed


def comparison(reference: list[float], candidate: list[float], dtype=torch.float32):
    runs = [demo.Run(name, losses) for name, losses in (("pytorch", reference),
                                                        ("fusedloss", candidate))]
    return demo.Comparison("t", *runs, demo.TOLERANCE[dtype], "loss layer", [])


def test_verdict_is_on_the_mean_of_the_last_ten_steps():
    reference = [5.0 - 0.1 * i for i in range(15)]
    close = comparison(reference, [x + 0.005 for x in reference])
    assert close.agrees()
    assert close.verdict() == (
        "verdict: max |difference| over 15 steps = 5.00e-03; final losses (mean of last 10 "
        "steps) pytorch 4.0500 vs fusedloss 4.0550: AGREE within 0.01 nats")
    apart = comparison(reference, [x + 0.02 for x in reference])
    assert not apart.agrees() and apart.verdict().endswith("DISAGREE within 0.01 nats")
    assert comparison(reference, [x + 0.02 for x in reference], torch.bfloat16).agrees()
    # An early gap alone does not fail it (the runs are compared where they end up) ...
    early = comparison(reference, [x + (1.0 if i < 5 else 0.0) for i, x in enumerate(reference)])
    assert early.agrees() and "max |difference| over 15 steps = 1.00e+00" in early.verdict()
    # ... nor do noise that averages out and a one-step jump (0.003 on the mean); a steady
    # offset above the tolerance does.
    noisy = [x + (0.012 if i % 2 else -0.012) for i, x in enumerate(reference)]
    assert comparison(reference, noisy).agrees()
    jump = [x + (0.03 if i == 14 else 0.0) for i, x in enumerate(reference)]
    assert comparison(reference, jump).agrees()
    assert not comparison(reference, [x + 0.011 for x in reference]).agrees()


@pytest.mark.slow  # ~8 s, three training steps on the interpreter: make test-slow
def test_script_runs_as_make_demo_runs_it(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--experiment", "clip", "--size", "tiny", "--steps", "3",
         "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.rstrip().splitlines()
    assert lines[0].startswith("fusedloss demo: CLIP-style two towers")
    assert "causal LM" not in result.stdout
    assert lines[-1].startswith("verdict: max |difference| over 3 steps")
    assert lines[-1].endswith(": AGREE within 0.01 nats")
    assert "profiler_start" not in result.stderr  # torch.profiler's log lines are silenced


def test_fusedloss_step_holds_less_memory_at_the_cpu_size():
    """One measured step of each at the size ``make demo`` trains on the CPU: PyTorch's step
    holds the B·T×V fp32 logits (and more of that size), fusedloss's well under half."""
    config = SimpleNamespace(**{**demo.SIZES["small"]["lm"], "steps": 1})  # measures step 0
    tokens = demo.ZipfMarkovTokens(config.vocab_size)
    with contextlib.redirect_stdout(io.StringIO()):
        peaks = {name: demo.train_lm(name, config, tokens, torch.device("cpu")).peak_bytes
                 for name in ("pytorch", "fusedloss")}
    logits_bytes = config.batch_size * config.seq_len * config.vocab_size * 4
    assert peaks["pytorch"] > 2 * logits_bytes
    assert peaks["fusedloss"] < 0.5 * peaks["pytorch"]
    assert peaks["fusedloss"] < 1.5 * logits_bytes


def test_example_uses_only_public_fusedloss_names():
    tree = ast.parse(EXAMPLE.read_text())
    modules = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names if alias.name.startswith("fusedloss")]
    modules += [node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module.startswith("fusedloss")]
    names = [alias.name for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and node.module.startswith("fusedloss")
             for alias in node.names]
    assert modules == ["fusedloss", "fusedloss.integrations.transformers"]
    assert names == ["apply_fusedloss"]
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "fusedloss"}
    assert used and used <= set(fusedloss.__all__)
