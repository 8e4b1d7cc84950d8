"""The ``ring`` benchmark suite (benchmarks/suites/ring.py) on CPU: its pure helpers, the replays
of the ring's transfers, and ``--quick`` runs end to end over 2 gloo processes (torchrun) and
over 1 process (no torchrun). NCCL, CUDA timing and memory, inf-cl and open_clip need GPUs (or
the peers installed) and are not run here.
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from unittest import mock

import pytest
import torch
from helpers import REPO_ROOT, import_benchmarks, read_results

(common, ring) = import_benchmarks("common", "suites.ring")

RUN_TIMEOUT_S = 240


# ----------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    "a, b, c, expected",
    [
        (10.0, 10.0, 4.0, 1.0),  # the transfers hide entirely behind compute
        (14.0, 10.0, 4.0, 0.0),  # nothing overlaps: a = b + c
        (12.0, 10.0, 4.0, 0.5),  # half of the shorter one hidden
        (6.0, 2.0, 5.0, 0.5),  # compute is the shorter one
        (20.0, 10.0, 4.0, 0.0),  # slower than serial (noise, waiting): clamped to 0
        (9.0, 10.0, 4.0, 1.0),  # faster than compute alone (noise): clamped to 1
    ],
)
def test_overlap_fraction(a, b, c, expected):
    assert ring.overlap_fraction(a, b, c) == pytest.approx(expected)


@pytest.mark.parametrize(
    "a, b, c", [(1.0, 1.0, 0.0), (1.0, 0.0, 1.0), (math.nan, 1.0, 1.0), (1.0, 1.0, math.inf)],
)
def test_overlap_fraction_undefined(a, b, c):
    assert ring.overlap_fraction(a, b, c) is None


def test_defaults_and_options():
    assert ring.DEFAULT_BATCHES == (65536, 131072, 262144, 524288, 1048576)
    assert common.int_list("65536, 131_072") == [65536, 131072]
    (run_module,) = import_benchmarks("run")
    args = run_module.build_parser().parse_args(["ring", "--batches", "1024,2048"])
    assert args.batches == [1024, 2048] and args.providers == list(ring.PROVIDER_KEYS)
    assert args.width is None and not args.no_overlap and not args.graph and args.min_reps == 3
    assert args.loss == "clip"
    assert run_module.build_parser().parse_args(["ring", "--loss", "siglip"]).loss == "siglip"
    with pytest.raises(SystemExit):
        run_module.build_parser().parse_args(["ring", "--loss", "info-nce"])
    with pytest.raises(SystemExit):
        run_module.build_parser().parse_args(["ring", "--batches", "12,x"])


def test_results_files_are_named_after_the_ranks(tmp_path):
    def names(device, slug, world, tag):
        env = {"device": device, "device_slug": slug, "date": "2026-12-01"}
        env["device_name"] = slug
        common.write_report(tmp_path / tag, "ring", tag if tag != "none" else None, env, "", [],
                            [], {}, "", world=world, log=lambda _line: None)
        return sorted(p.name for p in (tmp_path / tag).iterdir())

    assert names("cuda", "nvidia-h100-80gb-hbm3", 8, "none") == [
        "ring_2026-12-01_nvidia-h100-80gb-hbm3_8gpu.json",
        "ring_2026-12-01_nvidia-h100-80gb-hbm3_8gpu.md"]
    assert names("cpu", "cpu", 2, "Quick Run") == [
        "ring_2026-12-01_cpu_2proc_quick-run.json", "ring_2026-12-01_cpu_2proc_quick-run.md"]


def test_report_columns_keep_every_figure():
    row = {"case": "256×64 (2×128)", "provider": "fusedloss", "label": "fusedloss",
           "status": "ok", "note": "", "ms": 12.5, "peak_extra_mib": 321.0, "times_floor": 2.5,
           "loss": 6.54321, "loss_error": 2e-7, "check": "float64",
           "errors": {"dI": 1e-3, "dT": 2e-3, "ds": 3e-8}, "host_ms": 0.75, "graphed_ms": 11.75,
           "compute_ms": 10.5, "comm_ms": 4.0, "exposed_comm_ms": 2.0, "overlap": 0.5,
           "comm_bytes": 3 * 2**20}
    results = common.table(ring.RESULT_COLUMNS, [row])
    overlap = common.table(ring.OVERLAP_COLUMNS, [row])
    for text in ("| 12.5 |", "| 321 |", "| 2.50 |", "| 6.54321 |", "2.0e-07 (float64)",
                 "dI 1.0e-03, dT 2.0e-03, ds 3.0e-08"):
        assert text in results, text
    for text in ("| 12.5 |", "| 0.75 |", "| 11.8 |", "| 10.5 |", "| 4.00 |", "| 2.00 |",
                 "| 50 |", "| 3.0 |"):
        assert text in overlap, text
    peer = {"case": "c", "label": "inf-cl", "status": "not installed", "note": "no inf_cl"}
    assert "| not installed |" in common.table(ring.RESULT_COLUMNS, [peer])


# ----------------------------------------------------------------------------- transfer replays


class FakeShift:
    """A ``Shift`` that logs its posts and waits and "receives" tag + 1 everywhere."""

    calls: list = []

    def __init__(self, layout, send, recv, tag=0):
        FakeShift.calls.append(("post", tag, [tuple(t.shape) for t in send],
                                [tuple(t.shape) for t in recv], layout))
        self.tag = tag
        for buffer in recv:
            buffer.fill_(tag + 1)

    def wait(self):
        FakeShift.calls.append(("wait", self.tag))


def _step(shifts=2):
    """A ring step's transfers: a block (tag 0), read through views of its receive buffer, and
    a column-statistics pair (tag 2), in flight together."""
    from fusedloss.distributed import ring as ring_module

    block = torch.full((3, 4), float("nan"), dtype=torch.bfloat16)
    incoming = block.view(12).view(3, 4)
    stats = torch.full((2, 3), float("nan"))
    ahead = ring_module.Shift("layout", [torch.zeros(3, 4, dtype=torch.bfloat16)], [block], tag=0)
    if shifts == 2:
        ring_module.Shift("layout", [torch.zeros(2, 3)], [stats], tag=2).wait()
    ahead.wait()
    return incoming.clone(), stats.clone()


def test_recording_and_its_replays():
    FakeShift.calls = []
    with mock.patch(ring.RING_SHIFT, FakeShift):
        recording = ring.ShiftRecording(_step)
        assert recording.bytes_sent() == 3 * 4 * 2 + 2 * 3 * 4
        assert recording.events == [("post", 0), ("post", 1), ("wait", 1), ("wait", 0)]
        recorded = FakeShift.calls
        FakeShift.calls = []
        for _ in range(2):  # the cursor starts over with every step
            incoming, stats = recording.compute_only()
            assert FakeShift.calls == []  # no transfer: copies of what was received
            assert torch.equal(incoming, torch.ones(3, 4, dtype=torch.bfloat16))
            assert torch.equal(stats, torch.full((2, 3), 3.0))
        recording.step = lambda: _step(shifts=1)
        with pytest.raises(RuntimeError, match="made 1 transfers, the recording 2"):
            recording.compute_only()
        recording.transfers_only(torch.device("cpu"))()
    assert FakeShift.calls == recorded  # the same posts and waits, in the same order


# ----------------------------------------------------------------------------- end to end


def _run(command):
    out = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    assert out.returncode == 0, f"stdout:\n{out.stdout[-4000:]}\nstderr:\n{out.stderr[-4000:]}"
    return out


def _results(case, key):
    return next(r for r in case["results"] if r["provider"] == key)


@pytest.mark.slow
def test_quick_run_over_two_processes(tmp_path):
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "benchmarks/run.py", "ring", "--quick", "--device", "cpu",
                "--out", str(tmp_path)])
    data, markdown = read_results(tmp_path, "ring_*_cpu_2proc")
    assert data["suite"] == "ring" and data["settings"]["world_size"] == 2
    assert data["settings"]["dist_backend"] == "gloo" and data["settings"]["quick"]
    assert [(c["global_batch"], c["per_rank_batch"]) for c in data["cases"]] == [
        (256, 128), (512, 256)]
    for case in data["cases"]:
        ours = _results(case, "fusedloss")
        assert ours["status"] == "ok", ours["note"]
        assert ours["ms"] > 0 and len(ours["ms_per_rank"]) == 2
        assert ours["ms"] == max(ours["ms_per_rank"]) and ours["reps"] >= 3
        # The host's time to issue a call, for fusedloss alone (on the CPU: the whole call).
        assert len(ours["host_per_rank"]) == 2 and ours["host_ms"] == max(ours["host_per_rank"])
        assert all("host_ms" not in r for r in case["results"] if r["provider"] != "fusedloss")
        assert len(ours["rank_losses"]) == 2 and ours["times_floor"] > 0
        assert ours["loss_error"] < 1e-4 and case["reference"]["dtype"] == "float64"
        assert set(ours["errors"]) == {"dI", "dT", "ds"}
        assert max(ours["errors"].values()) < 1e-2
        # The overlap: compute only, transfers only, and the figures made of them.
        assert ours["compute_ms"] > 0 and ours["comm_ms"] > 0 and ours["comm_bytes"] > 0
        assert ours["exposed_comm_ms"] == pytest.approx(ours["ms"] - ours["compute_ms"])
        assert ours["overlap"] == pytest.approx(
            ring.overlap_fraction(ours["ms"], ours["compute_ms"], ours["comm_ms"]))
        assert "peak_extra_mib" not in ours  # no memory figures without CUDA
        assert _results(case, "inf-cl")["status"] in ("not installed", "unavailable")
        assert _results(case, "open-clip")["status"] in ("ok", "not installed")
    assert "--quick" in markdown and "## Communication and compute (fusedloss)" in markdown
    assert "| 512×64 (2×256) | fusedloss | ok |" in markdown
    assert "512×64 (2×256)  fusedloss" in out.stdout  # rank 0's table, printed once
    assert out.stdout.count("results: ") == 1


@pytest.mark.slow
def test_quick_siglip_run_over_two_processes(tmp_path):
    """``--loss siglip``: SigLIP at its initialization, its four gradients checked, the floor of
    its three products, inf-cl (no sigmoid loss) unavailable; ``--trace``: each rank's
    profiler trace of fusedloss's steps."""
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
          "benchmarks/run.py", "ring", "--quick", "--device", "cpu", "--loss", "siglip",
          "--batches", "256", "--no-overlap", "--trace", "--out", str(tmp_path)])
    for rank in (0, 1):
        with gzip.open(tmp_path / f"ring_trace_b256_rank{rank}.json.gz", "rt") as trace:
            events = json.load(trace)["traceEvents"]
        assert sum(event.get("ph") == "X" for event in events) > 10  # the steps' ops
    data, markdown = read_results(tmp_path, "ring_*_cpu_2proc")
    assert data["settings"]["loss"] == "siglip" and markdown.startswith("# Ring SigLIP")
    (case,) = data["cases"]
    ours = _results(case, "fusedloss")
    assert ours["status"] == "ok", ours["note"]
    assert ours["loss_error"] < 1e-4 and set(ours["errors"]) == {"dI", "dT", "ds", "db"}
    assert max(ours["errors"].values()) < 1e-2
    matmul = data["matmul"]["tflops"]
    assert case["floor_ms"] == pytest.approx(6.0 * 256**2 / 2 * 64 / matmul / 1e9)
    assert _results(case, "inf-cl")["status"] == "unavailable"
    assert ours["trace"] == "ring_trace_b256_rank0.json.gz"


@pytest.mark.slow  # ~11 s: make test-slow (the gloo ring tests stay in make test)
def test_quick_run_on_one_process_without_torchrun(tmp_path):
    _run([sys.executable, "benchmarks/run.py", "ring", "--quick", "--device", "cpu",
          "--providers", "fusedloss", "--batches", "128", "--graph", "--out", str(tmp_path),
          "--tag", "k1"])
    data, markdown = read_results(tmp_path, "ring_*_cpu_1proc_k1")
    (case,) = data["cases"]
    ours = _results(case, "fusedloss")
    assert ours["status"] == "ok" and case["per_rank_batch"] == 128
    assert ours["compute_ms"] > 0 and ours["comm_ms"] is None and ours["overlap"] is None
    assert ours["comm_note"] == "K = 1: the ring makes no transfers"
    assert data["settings"]["graph"] is True and "graphed_ms" not in ours
    assert "CUDA graphs need a CUDA device" in ours["graphed_note"]
    assert "| world_size | 1 |" in markdown
