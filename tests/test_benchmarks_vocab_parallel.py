"""The ``vocab-parallel`` benchmark suite (benchmarks/suites/vocab_parallel.py) on CPU: the
Megatron-style baseline in one process (world 1), and ``--quick`` end to end over 2 gloo
processes under torchrun. NCCL, CUDA timing and memory need GPUs and are not run here.
"""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import REPO_ROOT, import_benchmarks, read_results, rel_err

(vp,) = import_benchmarks("suites.vocab_parallel")

RUN_TIMEOUT_S = 240


# ----------------------------------------------------------------------------- options


def test_parser_defaults():
    (run_module,) = import_benchmarks("run")
    args = run_module.build_parser().parse_args(["vocab-parallel"])
    assert args.shapes == ["gemma2-2b", "llama3-8b"] and not args.quick


# ----------------------------------------------------------------------------- megatron baseline


@pytest.fixture
def world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_megatron_baseline_matches_cross_entropy_on_one_process(world_of_one):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(33, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 50, (33,), generator=generator)
    loss = vp.megatron_loss(hidden, weight, target, 0)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref = F.cross_entropy(hidden @ weight.T, target)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    # Megatron's logits go through .float(): float32 accuracy.
    assert float(loss) == pytest.approx(float(ref), rel=1e-6)
    for ours, theirs in zip(grads, ref_grads, strict=True):
        assert ours.dtype == torch.float64 and rel_err(ours, theirs) < 1e-5


def test_megatron_cross_entropy_of_a_shard_masks_foreign_targets(world_of_one):
    # One rank holding classes [10, 20) of 30: targets elsewhere contribute no target logit
    # and no one-hot (world 1: the all-reduces change nothing, so the loss is the shard's
    # logsumexp minus the target logit where owned, minus the row max elsewhere: the logits
    # are shifted by it before the masked target logit is taken).
    logits = torch.randn(6, 10, dtype=torch.float64)
    target = torch.tensor([0, 10, 15, 19, 20, 29])
    owned = (target >= 10) & (target < 20)
    leaf = logits.clone().requires_grad_(True)
    loss = vp.VocabParallelCrossEntropy.apply(leaf.clone(), target, 10, dist.group.WORLD)
    lse = torch.logsumexp(logits, dim=1)
    picked = torch.where(owned, logits[torch.arange(6), (target - 10).clamp(0, 9)],
                         logits.max(dim=1).values)
    torch.testing.assert_close(loss, lse - picked)
    (grad,) = torch.autograd.grad(loss.sum(), leaf)
    expected = torch.softmax(logits, dim=1)
    expected[torch.arange(6)[owned], target[owned] - 10] -= 1.0
    torch.testing.assert_close(grad, expected)


# ----------------------------------------------------------------------------- end to end


def _results(case, key):
    return next(r for r in case["results"] if r["provider"] == key)


@pytest.mark.slow
def test_quick_run_over_two_processes(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "benchmarks/run.py", "vocab-parallel", "--quick", "--device", "cpu", "--shapes",
         "gemma2-2b", "--out", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert out.returncode == 0, f"stdout:\n{out.stdout[-4000:]}\nstderr:\n{out.stderr[-4000:]}"
    data, markdown = read_results(tmp_path, "vocab_parallel_*_cpu_2proc")
    assert data["suite"] == "vocab-parallel" and data["settings"]["world_size"] == 2
    assert data["settings"]["dist_backend"] == "gloo" and data["settings"]["n"] == 128
    (case,) = data["cases"]
    assert (case["vocab_size"], case["hidden_size"], case["n"]) == (2000, 72, 128)
    assert case["shards"] == [[0, 1000], [1000, 2000]]  # [⌊r·V/K⌋, ⌊(r+1)·V/K⌋)
    single = _results(case, "single-gpu")
    assert single["status"] == "ok" and single["ms"] > 0 and len(single["ms_per_rank"]) == 1
    assert single["loss"] == pytest.approx(case["reference"]["single_gpu_loss"])
    assert single["loss"] == pytest.approx(0.678, abs=0.01)  # the float64 loss: 0.67837
    for key in ("fusedloss", "megatron"):
        result = _results(case, key)
        assert result["status"] == "ok", result["note"]
        assert result["ms"] == max(result["ms_per_rank"]) and len(result["ms_per_rank"]) == 2
        assert result["reps"] >= 3 and "peak_extra_mib" not in result
        assert len(result["rank_losses"]) == 2 and result["times_floor"] > 0
        assert result["loss_error"] < 2e-3 and set(result["errors"]) == {"dE", "dC"}
        assert max(result["errors"].values()) < 2e-2
    ours = _results(case, "fusedloss")
    assert ours["loss_error"] < 1e-5  # the same head, sharded
    assert ours["errors"]["dE"] < 1e-3 and ours["errors"]["dC"] < 1e-3
    assert "| gemma2-2b (2000, 72) peaked, N=128, K=2 | megatron | ok |" in markdown
    assert out.stdout.count("results: ") == 1
