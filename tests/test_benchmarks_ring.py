"""The ``ring`` benchmark suite (benchmarks/suites/ring.py) on CPU: its pure helpers, the replay
of the ring's transfers, and ``--quick`` runs end to end over 2 gloo processes (torchrun) and
over 1 process (no torchrun). NCCL, CUDA timing and memory, inf-cl and open_clip need GPUs (or
the peers installed) and are not run here.
"""

from __future__ import annotations

import math
import subprocess
import sys

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
    "a, b, c", [(1.0, 1.0, 0.0), (1.0, 0.0, 1.0), (None, 1.0, 1.0), (1.0, None, 1.0),
                (1.0, 1.0, None), (math.nan, 1.0, 1.0), (1.0, 1.0, math.inf)],
)
def test_overlap_fraction_undefined(a, b, c):
    assert ring.overlap_fraction(a, b, c) is None


def test_exposed_communication():
    assert ring.exposed_comm_ms(12.0, 10.0) == pytest.approx(2.0)
    assert ring.exposed_comm_ms(9.5, 10.0) == pytest.approx(-0.5)  # noise stays visible
    assert ring.exposed_comm_ms(None, 10.0) is None
    assert ring.exposed_comm_ms(12.0, None) is None


def test_case_list_per_rank_batches_and_order():
    cases = ring.select_cases([65536, 1048576], 512, 8)
    assert [(c.batch, c.regime, c.per_rank) for c in cases] == [
        (65536, "random", 8192), (1048576, "random", 131072),
    ]
    assert cases[0].key == "B=65536 random"
    assert cases[0].label == "65536×512 (8×8192) random"
    assert cases[0].logit_scale == pytest.approx(1 / 0.07)
    # One rank's share of the one-pass floor: 8·b_r·B·c / R.
    assert cases[0].floor_ms(1000.0) == pytest.approx(8 * 8192 * 65536 * 512 / 1e15 * 1e3)
    single = ring.select_cases([512], 64, 1)
    assert single[0].per_rank == 512 and single[0].world == 1


def test_case_list_rejects_uneven_batches():
    with pytest.raises(ValueError, match=r"\[256, 512\] do not split evenly over 3 ranks"):
        ring.select_cases([256, 384, 512], 64, 3)
    with pytest.raises(ValueError, match="split evenly"):
        ring.select_cases([2], 64, 4)
    with pytest.raises(ValueError, match="world size"):
        ring.select_cases([8], 64, 0)


def test_references_by_size():
    small, mid, large = (ring.Case(b, 8, 512) for b in (16384, 262144, 524288))
    assert small.reference_grads and small.reference_loss
    assert not mid.reference_grads and mid.reference_loss
    assert not large.reference_grads and not large.reference_loss
    quick = ring.Case(512, 2, 64)
    assert quick.reference_grads


def test_defaults_and_batches_option():
    assert ring.DEFAULT_BATCHES == (65536, 131072, 262144, 524288, 1048576)
    assert ring.positive_int_list("65536, 131_072") == [65536, 131072]
    for bad in ("", "0", "12,x", "-4"):
        with pytest.raises(Exception, match="integers|positive"):
            ring.positive_int_list(bad)
    (run_module,) = import_benchmarks("run")
    args = run_module.build_parser().parse_args(["ring", "--batches", "1024,2048"])
    assert args.batches == [1024, 2048] and args.providers == list(ring.PROVIDER_KEYS)
    assert args.width is None and not args.no_overlap and not args.graph


def test_results_files_are_named_after_the_ranks(tmp_path):
    def names(device, slug, world, tag):
        env = {"device": device, "device_slug": slug, "date": "2026-12-01"}
        common.report_results(tmp_path / tag, ring.NAME, tag if tag != "none" else None, env,
                              [], markdown="", payload={}, tables="", world=world,
                              log=lambda _line: None)
        return sorted(p.name for p in (tmp_path / tag).iterdir())

    assert names("cuda", "nvidia-h100-80gb-hbm3", 8, "none") == [
        "ring_2026-12-01_nvidia-h100-80gb-hbm3_8gpu.json",
        "ring_2026-12-01_nvidia-h100-80gb-hbm3_8gpu.md"]
    assert names("cpu", "cpu", 2, "Quick Run") == [
        "ring_2026-12-01_cpu_2proc_quick-run.json", "ring_2026-12-01_cpu_2proc_quick-run.md"]


def test_cross_check_without_reference_compares_peers_with_fusedloss():
    def result(key, loss, status="ok"):
        return ring.ProviderResult(key, key, status=status, ms=1.0, loss=loss)

    case = ring.CaseResult(ring.Case(1048576, 8, 512), None)
    case.results = {"fusedloss": result("fusedloss", 7.0), "open-clip": result("open-clip", 7.05),
                    "inf-cl": result("inf-cl", 8.0)}
    ring.cross_check(case)
    ours, close, far = case.results.values()
    assert ours.status == "ok" and ours.loss_error is None
    assert close.status == "ok" and close.check == "fusedloss"
    assert close.loss_error == pytest.approx(0.05)
    assert far.status == "wrong" and "fusedloss's" in far.note
    lonely = ring.CaseResult(ring.Case(1048576, 8, 512), None)
    lonely.results = {"fusedloss": result("fusedloss", None, status="failed"),
                      "inf-cl": result("inf-cl", 8.0)}
    ring.cross_check(lonely)
    assert lonely.results["inf-cl"].status == "ok"
    assert lonely.results["inf-cl"].check.startswith("unchecked")


# ----------------------------------------------------------------------------- transfer replay


def _recording():
    """A recorded step of two shifts: a block (tag 0) and a column-statistics pair (tag 2)."""
    block = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    stats = torch.ones(2, 3)
    recording = ring.ShiftRecording()
    recording.shifts = [
        ring.RecordedShift(0, [((3, 4), torch.bfloat16)], [((3, 4), torch.bfloat16)], [block],
                           "layout"),
        ring.RecordedShift(2, [((2, 3), torch.float32)], [((2, 3), torch.float32)], [stats],
                           "layout"),
    ]
    recording.events = [("post", 0), ("post", 1), ("wait", 1), ("wait", 0)]
    return recording, block, stats


def test_compute_only_replay_copies_the_recorded_tensors():
    recording, block, stats = _recording()
    assert recording.bytes_sent == 3 * 4 * 2 + 2 * 3 * 4
    replay = ring.ComputeOnly(recording)
    shift = replay.shift_class()
    received = []

    def step():
        # The ring reads what arrives through views of its receive buffers: the replay must
        # fill the buffers themselves.
        buffer = torch.full((3, 4), float("nan"), dtype=torch.bfloat16)
        view = buffer.view(12)
        incoming = view.view(3, 4)
        arriving = torch.empty(2, 3)
        ahead = shift("layout", [torch.zeros(3, 4, dtype=torch.bfloat16)], [buffer], tag=0)
        behind = shift("layout", [torch.zeros(2, 3)], [arriving], tag=2)
        behind.wait()
        ahead.wait()
        received.append((incoming, arriving))

    for _ in range(2):  # the cursor starts over with every step
        replay.wrap(step)()
    for incoming, arriving in received:
        assert torch.equal(incoming, block) and torch.equal(arriving, stats)

    def one_shift_only():
        shift("layout", [torch.zeros(3, 4, dtype=torch.bfloat16)],
              [torch.empty(3, 4, dtype=torch.bfloat16)], tag=0)

    with pytest.raises(RuntimeError, match="made 1 transfers, the recorded step 2"):
        replay.wrap(one_shift_only)()

    def other_shapes():
        shift("layout", [torch.zeros(5, 4)], [torch.empty(5, 4)], tag=0)

    with pytest.raises(RuntimeError, match="differ from the recorded"):
        replay.wrap(other_shapes)()
    recording.release()
    assert all(not s.recv for s in recording.shifts)


def test_transfers_only_replays_posts_and_waits_in_order(monkeypatch):
    recording, _, _ = _recording()
    recording.release()  # the plan needs the shapes only
    calls = []

    class FakeShift:
        def __init__(self, layout, send, recv, tag=0):
            calls.append(("post", tag, [tuple(t.shape) for t in send],
                          [tuple(t.shape) for t in recv], layout))
            self.tag = tag

        def wait(self):
            calls.append(("wait", self.tag))

    from fusedloss.distributed import ring as ring_module

    monkeypatch.setattr(ring_module, "Shift", FakeShift)
    run = ring.transfers_only(recording, torch.device("cpu"))
    run()
    assert calls == [
        ("post", 0, [(3, 4)], [(3, 4)], "layout"),
        ("post", 2, [(2, 3)], [(2, 3)], "layout"),
        ("wait", 2),
        ("wait", 0),
    ]


def test_ring_shift_replaced_restores_the_original():
    from fusedloss.distributed import ring as ring_module

    original = ring_module.Shift
    with pytest.raises(KeyError), ring.ring_shift_replaced(dict):
        assert ring_module.Shift is dict
        raise KeyError("inside")
    assert ring_module.Shift is original


# ----------------------------------------------------------------------------- end to end


def _run(command, tmp_path):
    out = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    assert out.returncode == 0, f"stdout:\n{out.stdout[-4000:]}\nstderr:\n{out.stderr[-4000:]}"
    return out


def _results(case, key):
    return next(r for r in case["results"] if r["provider"] == key)


def test_quick_run_over_two_processes(tmp_path):
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "benchmarks/run.py", "ring", "--quick", "--device", "cpu",
                "--out", str(tmp_path)], tmp_path)
    data, markdown = read_results(tmp_path, "ring_*_cpu_2proc")
    assert data["suite"] == "ring" and data["settings"]["world_size"] == 2
    assert data["settings"]["dist_backend"] == "gloo" and data["settings"]["quick"]
    assert [(c["global_batch"], c["per_rank_batch"], c["width"]) for c in data["cases"]] == [
        (256, 128, 64), (512, 256, 64)]
    for case in data["cases"]:
        ours = _results(case, "fusedloss")
        assert ours["status"] == "ok", ours["note"]
        assert ours["ms"] > 0 and len(ours["ms_per_rank"]) == 2
        assert ours["ms"] == max(ours["ms_per_rank"]) and ours["reps"] >= 3
        # The host's time to issue a call, measured for fusedloss alone (on the CPU the wall
        # clock of a call: the whole call).
        assert len(ours["host_per_rank"]) == 2 and ours["host_ms"] == max(ours["host_per_rank"])
        assert ours["host_ms"] > 0
        for peer in case["results"]:
            if peer["provider"] != "fusedloss":
                assert peer["host_ms"] is None and peer["host_per_rank"] == []
        assert len(ours["rank_losses"]) == 2
        assert ours["loss_error"] < 1e-4 and case["reference"]["dtype"] == "float64"
        assert set(ours["errors"]) == {"dI", "dT", "ds"}
        assert max(ours["errors"].values()) < 1e-2
        # The overlap: compute only, transfers only, and the figures made of them.
        assert ours["compute_ms"] > 0 and ours["comm_ms"] > 0 and ours["comm_bytes"] > 0
        assert ours["exposed_comm_ms"] == pytest.approx(ours["ms"] - ours["compute_ms"])
        assert ours["overlap"] == pytest.approx(
            ring.overlap_fraction(ours["ms"], ours["compute_ms"], ours["comm_ms"]))
        assert ours["peak_extra_mib"] is None  # no memory figures without CUDA
        assert _results(case, "inf-cl")["status"] in ("not installed", "unavailable")
        assert _results(case, "open-clip")["status"] in ("ok", "not installed")
    assert "--quick run" in markdown and "## Communication and compute (fusedloss)" in markdown
    assert "| 512×64 (2×256) random |" in markdown
    assert "fusedloss.distributed.clip_loss" in markdown
    assert "B=512 random  fusedloss" in out.stdout  # rank 0's table, printed once
    assert out.stdout.count("results: ") == 1


def test_quick_run_on_one_process_without_torchrun(tmp_path):
    _run([sys.executable, "benchmarks/run.py", "ring", "--quick", "--device", "cpu",
          "--providers", "fusedloss", "--batches", "128", "--out", str(tmp_path),
          "--tag", "k1"], tmp_path)
    data, markdown = read_results(tmp_path, "ring_*_cpu_1proc_k1")
    (case,) = data["cases"]
    ours = _results(case, "fusedloss")
    assert ours["status"] == "ok" and case["per_rank_batch"] == 128
    assert ours["compute_ms"] > 0 and ours["comm_ms"] is None and ours["overlap"] is None
    assert ours["overlap_note"] == "K = 1: the ring makes no transfers"
    assert "K = 1 (CPU process)" in markdown
    assert data["settings"]["graph"] is False and ours["graphed_ms"] is None
    assert "not measured (without --graph)" in markdown


def test_graph_option_on_the_cpu_says_why_nothing_was_graphed(tmp_path):
    _run([sys.executable, "benchmarks/run.py", "ring", "--quick", "--device", "cpu",
          "--providers", "fusedloss", "--batches", "128", "--no-overlap", "--graph",
          "--out", str(tmp_path), "--tag", "graph"], tmp_path)
    data, markdown = read_results(tmp_path, "ring_*_cpu_1proc_graph")
    ours = _results(data["cases"][0], "fusedloss")
    assert data["settings"]["graph"] is True and ours["graphed_ms"] is None
    assert ours["graphed_note"] == "not graphed: CUDA graphs need a CUDA device"
    assert "torch.cuda.CUDAGraph" in markdown and "| graphed |" in markdown


def test_report_keeps_every_figure():
    """render_markdown and results_json on made-up results: each figure appears in both."""
    ours = ring.ProviderResult(
        "fusedloss", "fusedloss", ms=12.5, reps=7, ms_per_rank=[12.5, 11.25], host_ms=0.75,
        host_per_rank=[0.75, 0.5], first_call_ms=99.5, peak_extra_mib=321.0,
        peak_per_rank=[321.0, 300.0], loss=6.54321, rank_losses=[6.5, 6.58642],
        loss_error=2e-7, check="float64", errors={"dI": 1e-3, "dT": 2e-3, "ds": 3e-8},
        compute_ms=10.5, compute_per_rank=[10.5, 10.0], comm_ms=4.0, comm_per_rank=[4.0, 3.5],
        exposed_comm_ms=2.0, overlap=0.5, comm_bytes=3 * 2**20, graphed_ms=11.75,
        graphed_per_rank=[11.75, 11.5], call="clip_loss(...)")
    peer = ring.ProviderResult("inf-cl", "inf-cl", status="not installed", note="no inf_cl")
    case = ring.CaseResult(ring.Case(256, 2, 64), None, {"fusedloss": ours, "inf-cl": peer})
    env = {"device_name": "cpu", "device": "cpu", "date": "2026-12-01", "timestamp": "t",
           "torch": "2", "triton": "3", "cuda": None}
    settings = {"world_size": 2, "dist_backend": "gloo", "dtype": "bf16", "width": 64,
                "batches": [256], "seed": 0, "quick": True, "warmup_ms": 5.0, "rep_ms": 20.0,
                "min_reps": 3, "backend": "torch", "overlap": True, "graph": True}
    info = {"environment": env, "settings": settings,
            "matmul": {"dtype": "bf16", "size": 256, "ms": 1.0, "tflops": 1.0},
            "peer_versions": {"inf-cl": None}, "calls": {"fusedloss": "clip_loss(...)"},
            "notes": ["a note"]}
    markdown = ring.render_markdown(info, [case])
    for text in ("| 12.5 |", "12.5 / 11.2", "| 0.75 |", "| 11.8 |", "| 10.5 |", "| 4.00 |",
                 "| 2.00 |", "| 50% |", "| 3.0 |", "| 0.8 |", "| 12.5 / 321 |", "321 / 300",
                 "6.54321", "2.0e-07 (float64)", "dI 1.0e-03, dT 2.0e-03, ds 3.0e-08", "99.5",
                 "| 7 |", "not installed",
                 "no inf_cl", "`clip_loss(...)`", "- a note", "— (none)"):
        assert text in markdown, text
    data = ring.results_json(info, [case])
    (row, other) = data["cases"][0]["results"]
    assert row["comm_gbps"] == pytest.approx(3 * 2**20 / 4e-3 / 1e9)
    for key in ("ms", "ms_per_rank", "host_per_rank", "peak_per_rank", "rank_losses", "errors",
                "compute_per_rank", "comm_per_rank", "exposed_comm_ms", "overlap", "graphed_ms",
                "graphed_per_rank", "first_call_ms", "reps"):
        assert row[key] == getattr(ours, key), key
    assert other["status"] == "not installed" and data["notes"] == ["a note"]
    assert data["cases"][0]["floor_ms"] == pytest.approx(8 * 128 * 256 * 64 / 1e12 * 1e3)


def test_providers():
    providers = ring.ring_providers("torch")
    assert list(providers) == list(ring.PROVIDER_KEYS)
    assert 'backend="torch"' in providers["fusedloss"].call
    assert providers["fusedloss"].display_name() == "fusedloss"
    assert providers["inf-cl"].scale_grad_summed and not providers["fusedloss"].scale_grad_summed
    case = ring.Case(256, 2, 64)
    # open_clip keeps two b_r × B log-softmax outputs; the others need no prediction.
    assert providers["open-clip"].required_bytes(case, 2) == 2 * 128 * 256 * 2
    assert providers["fusedloss"].required_bytes(case, 2) == 0
