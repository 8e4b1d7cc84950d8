"""Smoke test of the retrieval suite (benchmarks/suites/retrieval.py): a ``--quick`` run on the
CPU, sentence-transformers' losses and fusedloss's, each fused loss's per-step losses equal to
sentence-transformers' same loss (same seed, dropout on)."""

from __future__ import annotations

import pytest
from helpers import import_benchmarks, read_results

pytest.importorskip("sentence_transformers")
(run_module,) = import_benchmarks("run")


@pytest.mark.slow  # ~10 s of training steps on two cores: ``make test-slow``
def test_quick_run_end_to_end(tmp_path):
    argv = ["retrieval", "--quick", "--largest", "--largest-cap", "32", "--device", "cpu",
            "--out", str(tmp_path)]
    assert run_module.main(argv) == 0
    data, markdown = read_results(tmp_path, "retrieval_*_cpu")
    assert markdown.startswith("# sentence-transformers training steps")
    rows = data["rows"]
    assert {(r["batch"], r["method"]) for r in rows} == {
        (b, m) for b in (16, 32) for m in ("st-plain", "fused-plain", "st-cached",
                                           "fused-cached")}
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] > 0 and len(r["losses"]) == 3
        assert r["loss_gap"] < 1e-5, r
    assert data["largest"] == {"st-plain": 32, "fused-plain": 32}
