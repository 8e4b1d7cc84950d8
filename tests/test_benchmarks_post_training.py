"""Smoke test of the post-training suite (benchmarks/suites/post_training.py): a ``--quick``
run on the CPU (the torch backend; TRL's head where TRL is installed, liger-kernel's losses
where it is), every method's row present and fusedloss's loss and d input checked against the
fp32 computation (a peer's errors are reported, not bounded here)."""

from __future__ import annotations

import pytest
from helpers import import_benchmarks, read_results

(run_module,) = import_benchmarks("run")


@pytest.mark.slow  # ~12 s: make test-slow
def test_quick_run_end_to_end(tmp_path):
    argv = ["post-training", "--quick", "--shapes", "phi3.5", "--rep-ms", "1", "--warmup-ms",
            "0", "--device", "cpu", "--out", str(tmp_path)]
    assert run_module.main(argv) == 0
    data, markdown = read_results(tmp_path, "post_training_*_cpu")
    assert markdown.startswith("# Post-training losses through an LM head")
    rows = data["rows"]
    assert {(r["loss"], r["method"]) for r in rows} >= {
        ("cross-entropy", "fusedloss"), ("product", "cuBLAS"), ("log-probs", "fusedloss"),
        ("grpo", "fusedloss"), ("dpo", "fusedloss"), ("jsd", "fusedloss")}
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] > 0 and r["head"] == "phi3.5" and r["n"] == 256
        if "loss_error" in r and r["method"] == "fusedloss":  # a peer's error is its own
            # bf16 logits of a teacher near the student: JSD's gradient is the loosest
            assert r["loss_error"] < 2e-2 and r["grad_error"] < 0.2, r
