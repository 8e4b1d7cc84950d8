"""The ``grad-cache`` suite's ``--quick`` run over 2 gloo processes: check, sweep, stop."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO_ROOT, import_benchmarks, read_results

(grad_cache,) = import_benchmarks("suites.grad_cache")

RUN_TIMEOUT_S = 240


def _run(args, tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "benchmarks/run.py", "grad-cache", "--quick", "--device",
               "cpu", "--out", str(tmp_path), *args]
    out = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    assert out.returncode == 0, f"stdout:\n{out.stdout[-4000:]}\nstderr:\n{out.stderr[-4000:]}"
    return out


@pytest.mark.slow
def test_quick_run_checks_both_methods_and_sweeps(tmp_path):
    _run([], tmp_path)
    data, markdown = read_results(tmp_path, "grad_cache_*_cpu_2proc")
    settings = data["settings"]
    assert settings["world_size"] == 2 and settings["micro_batch"] == grad_cache.QUICK_MICRO_BATCH
    check = data["check"]
    assert check["status"] == "ok", check["note"]
    assert check["max_gradient_error"] < grad_cache.CHECK_TOLERANCE
    assert check["loss_plain"] == check["loss_grad_cache"]
    rows = [(r["method"], r["batch"], r["per_rank"], r["status"]) for r in data["rows"]]
    assert rows == [("plain", 64, 32, "ok"), ("plain", 128, 64, "ok"),
                    ("grad-cache", 64, 32, "ok"), ("grad-cache", 128, 64, "ok")]
    for row in data["rows"]:
        assert row["ms"] > 0 and len(row["ms_per_rank"]) == 2 and row["loss"] > 0
    assert data["largest"] == {"plain": 128, "grad-cache": 128}
    assert "| grad-cache | 128 | 64 | ok |" in markdown


@pytest.mark.slow
def test_sweep_stops_after_a_step_over_the_limit(tmp_path):
    _run(["--batches", "32,64,128", "--max-step-s", "0", "--micro-batch", "8", "--tag", "limit"],
         tmp_path)
    data, _ = read_results(tmp_path, "grad_cache_*_cpu_2proc_limit")
    assert data["settings"]["micro_batch"] == 8 and data["check"]["batch"] == 32
    assert [(r["method"], r["batch"]) for r in data["rows"]] == [("plain", 32),
                                                                 ("grad-cache", 32)]
