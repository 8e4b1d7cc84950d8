"""The ``vocab-parallel`` benchmark suite (benchmarks/suites/vocab_parallel.py) on CPU: its pure
helpers, the Megatron-style baseline in one process (world 1), and ``--quick`` end to end over 2
gloo processes under torchrun. NCCL, CUDA timing and memory need GPUs and are not run here.
"""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import REPO_ROOT, import_benchmarks, read_results, rel_err

(vp,) = import_benchmarks("suites.vocab_parallel")

RUN_TIMEOUT_S = 240


# ----------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize("vocab, world", [(2000, 2), (1002, 4), (7, 3), (256000, 8), (5, 5)])
def test_shard_bounds_tile_the_vocabulary(vocab, world):
    bounds = [vp.shard_bounds(vocab, world, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_shard_bounds_uneven_and_bad_rank():
    assert [vp.shard_bounds(10, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]
    with pytest.raises(ValueError, match="outside"):
        vp.shard_bounds(10, 3, 3)


def test_case_list_quick_shapes_and_stem():
    cases = vp.select_cases(["gemma2-2b", "llama3-8b"], 128, 2, quick=True)
    assert [(c.shape.vocab_size, c.shape.hidden_size, c.regime) for c in cases] == [
        (2000, 72, "peaked"), (1002, 128, "peaked")]
    assert cases[0].key == "gemma2-2b peaked" and cases[0].bounds(1) == (1000, 2000)
    full = vp.select_cases(["gemma2-2b"], 8192, 8, quick=False)
    assert full[0].shape.vocab_size == 256000 and full[0].bounds(7) == (224000, 256000)
    with pytest.raises(ValueError, match="cannot be shared"):
        vp.select_cases(["phi3.5"], 8, 1000, quick=True)


def test_parser_defaults():
    (run_module,) = import_benchmarks("run")
    args = run_module.build_parser().parse_args(["vocab-parallel"])
    assert args.shapes == ["gemma2-2b", "llama3-8b"] and args.min_reps == 3


# ----------------------------------------------------------------------------- megatron baseline


@pytest.fixture
def world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{vp_free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def vp_free_port():
    from benchmarks.suites import ring

    return ring._free_port()


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


def test_quick_run_over_two_processes(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "benchmarks/run.py", "vocab-parallel", "--quick", "--device", "cpu", "--shapes",
         "gemma2-2b", "--out", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert out.returncode == 0, f"stdout:\n{out.stdout[-4000:]}\nstderr:\n{out.stderr[-4000:]}"
    data, markdown = read_results(tmp_path, "vocab_parallel_*_cpu_2proc")
    assert data["suite"] == "vocab-parallel" and data["settings"]["world_size"] == 2
    assert data["settings"]["dist_backend"] == "gloo" and data["settings"]["f64_reference"]
    assert [(c["vocab_size"], c["hidden_size"], c["n"], c["regime"]) for c in data["cases"]] == [
        (2000, 72, 128, "peaked")]
    for case in data["cases"]:
        assert case["shards"] == [[0, 1000], [1000, 2000]]
        reference = case["reference"]
        assert reference["gradients"]
        assert reference["single_gpu_loss"] == pytest.approx(reference["float64_loss"], rel=1e-3)
        for key in ("fusedloss", "megatron"):
            result = _results(case, key)
            assert result["status"] == "ok", result["note"]
            assert result["ms"] == max(result["ms_per_rank"]) and len(result["ms_per_rank"]) == 2
            assert result["reps"] >= 3 and result["peak_extra_mib"] is None
            assert len(result["rank_losses"]) == 2
            assert result["loss_error"] < 2e-3 and result["f64_loss_error"] < 2e-3
            assert set(result["errors"]) == {"dE", "dC", "dE f64", "dC f64"}
            assert max(result["errors"].values()) < 2e-2
        ours = _results(case, "fusedloss")
        assert ours["loss_error"] < 1e-5  # the same head, sharded
        assert ours["errors"]["dE"] < 1e-3 and ours["errors"]["dC"] < 1e-3
        single = _results(case, "single-gpu")
        assert single["status"] == "ok" and single["ms"] > 0 and len(single["ms_per_rank"]) == 1
        assert single["loss"] == pytest.approx(reference["single_gpu_loss"])
    assert "--quick run" in markdown and "## All figures" in markdown
    assert "| gemma2-2b (2000, 72) peaked, N=128, K=2 |" in markdown
    assert "process_group=WORLD" in markdown and "_VocabParallelCrossEntropy" in markdown
    assert out.stdout.count("results: ") == 1
