"""core/replay.py: a replayed call gives what the call itself gives.

On the CPU (no CUDA graphs) a stand-in graph re-runs the captured function on the graph's own
input buffers at each replay, so that the signature, the copies in and out and the cache are
tested where CI runs; on a GPU the real graphs run.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, launches_of, requires_cuda, requires_triton

import fusedloss
from fusedloss.core import config, engine, replay
from fusedloss.ops import _common


class _Rerun:
    """A stand-in for a captured graph: replay runs ``fn`` again on the captured buffers and
    writes its results into the captured outputs."""

    def __init__(self, fn, spec, inputs, outputs):
        self.fn, self.spec, self.inputs, self.outputs = fn, spec, inputs, outputs
        self.replays = 0

    def replay(self):
        fresh: list[torch.Tensor] = []
        replay._flatten(_inside_capture(self.fn, self.spec, self.inputs), fresh, None)
        for out, value in zip(self.outputs, fresh, strict=True):
            out.copy_(value)
        self.replays += 1

    run = replay  # a ``replay._Tape``'s replay


_CAPTURING = []


def _inside_capture(fn, spec, inputs):
    """``fn`` on the graph's buffers, with nested calls not replayed, as while capturing."""
    _CAPTURING.append(True)
    try:
        args, kwargs = replay._unflatten(spec, inputs)
        return fn(*args, **dict(kwargs))
    finally:
        _CAPTURING.pop()


@pytest.fixture
def graphs(monkeypatch):
    """Replay on every device, through ``_Rerun`` where CUDA graphs are not available; yields
    the list of graphs captured."""
    captured = []
    replay.clear()
    if not torch.cuda.is_available():
        def capture(fn, spec, leaves):
            inputs = replay._input_buffers(leaves)
            for buffer, t in zip(inputs, leaves, strict=True):
                buffer.copy_(t)  # (a real capture runs nothing: any values would do)
            outputs: list[torch.Tensor] = []
            out_spec = replay._flatten(_inside_capture(fn, spec, inputs), outputs, None)
            graph = _Rerun(fn, spec, inputs, outputs)
            captured.append(graph)
            return replay._Graph(graph, inputs, out_spec, outputs)

        monkeypatch.setattr(replay, "_capture", capture)
        monkeypatch.setattr(replay, "applies", lambda device, work: (
            0 < work <= config.tuning().replay_work and not config.tuning().check_values
            and not _CAPTURING))
    else:
        real = replay._capture

        def capture(fn, spec, leaves):
            entry = real(fn, spec, leaves)
            captured.append(entry)
            return entry

        monkeypatch.setattr(replay, "_capture", capture)
    yield captured
    replay.clear()


def _features(seed: int, n: int, d: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    return x.to(DEVICE, dtype).requires_grad_()


def _clip_step(a, b, scale, kind="clip"):
    losses = {
        "clip": lambda: fusedloss.clip_loss(a, b, scale, backend="triton"),
        "info_nce": lambda: fusedloss.info_nce_loss(a, b, temperature=1 / scale.detach(),
                                                    backend="triton"),
        "nt_xent": lambda: fusedloss.nt_xent_loss(torch.cat([a, b]), 1 / scale.detach(),
                                                  backend="triton"),
    }
    loss = losses[kind]()
    inputs = [t for t in (a, b, scale) if t.requires_grad][:3 if kind == "clip" else 2]
    return loss.detach(), torch.autograd.grad(loss, inputs)


@requires_triton
@pytest.mark.parametrize("kind", ["clip", "info_nce", "nt_xent"])
def test_replayed_steps_equal_direct_ones(graphs, tune, kind):
    """Three steps on new values each: the first direct, the second captured, the third
    replayed; each equals the same step with replay off (and the fp32 dA accumulator, a
    replayed backward's), exactly."""
    n, d = 48, 32
    scale = torch.tensor(10.0, device=DEVICE, requires_grad=True)
    for seed in range(3):
        a, b = _features(seed, n, d), _features(seed + 10, n, d)
        tune(replay_work=1 << 40)
        got = _clip_step(a, b, scale, kind)
        with config.tuned(replay_work=0, split_accumulator=False):
            want = _clip_step(a, b, scale, kind)
        for g, w in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert len(graphs) == 2  # the forward op's and the backward op's
    # The backward reads A and B from the forward's buffers.
    forward, backward = ({id(t) for t in g.inputs} for g in graphs)
    assert len(forward & backward) >= (1 if kind == "nt_xent" else 2)
    if not torch.cuda.is_available():
        assert all(g.replays == 2 for g in graphs)  # the second step's and the third's


@requires_triton
@pytest.mark.parametrize("replay_work", [0, 1 << 40])
def test_a_replayed_backward_accumulates_in_fp32(monkeypatch, graphs, tune, replay_work):
    """bf16 features of a few rows: the backward's dA accumulates as a bf16 pair when the
    call runs directly, in fp32 in every call of a replayed signature (its first, direct call
    too, so that every step of it gives the same gradients)."""
    from fusedloss.core import lse_backward

    used = launches_of(monkeypatch, lse_backward, "_accumulate_split_kernel")
    tune(replay_work=replay_work)
    scale = torch.tensor(10.0, device=DEVICE)
    _clip_step(_features(0, 32, 32), _features(1, 32, 32), scale)  # a first call: direct
    assert bool(used) == (replay_work == 0)


@requires_triton
@pytest.mark.parametrize("replay_work", [0, 1 << 40])
def test_a_replayed_backward_takes_wide_slabs(monkeypatch, graphs, tune, replay_work):
    """A replayed backward asks for slabs of 4096 columns (``scratch_bytes(wide=True)``); a
    direct one for the default scratch."""
    from fusedloss.ops import contrastive as ops

    asked = []

    def spy(a, split=False, wide=False):
        asked.append(wide)
        return _common.scratch_bytes(a, split, wide)

    monkeypatch.setattr(ops, "scratch_bytes", spy)
    tune(replay_work=replay_work)
    scale = torch.tensor(10.0, device=DEVICE)
    for seed in range(2):
        _clip_step(_features(seed, 32, 32), _features(seed + 1, 32, 32), scale)
    assert asked and all(wide == (replay_work > 0) for wide in asked)


@requires_triton
def test_a_new_shape_or_tuning_is_a_new_signature(graphs, tune):
    tune(replay_work=1 << 40)
    scale = torch.tensor(10.0, device=DEVICE)
    for n in (32, 32, 40, 40, 32):
        _clip_step(_features(n, n, 32), _features(n + 1, n, 32), scale)
    assert len(graphs) == 4  # 32 and 40 rows, forward and backward
    with config.tuned(split_accumulator=False):
        for _ in range(2):
            _clip_step(_features(0, 32, 32), _features(1, 32, 32), scale)
    assert len(graphs) == 6


@requires_triton
def test_work_bound_and_read_backs_turn_replay_off(graphs, tune):
    scale = torch.tensor(10.0, device=DEVICE)
    a, b = _features(0, 32, 32), _features(1, 32, 32)
    tune(replay_work=32 * 32 * 32 - 1)  # one multiply-add short of this call's products
    for _ in range(3):
        _clip_step(a, b, scale)
    tune(replay_work=1 << 40, check_values=True)
    for _ in range(3):
        _clip_step(a, b, scale)
    tune(check_values=False)
    with engine.recording_backward_tiles() as record:  # a replay would skip the recording
        for _ in range(3):
            _clip_step(a, b, scale)
    assert len(record) == 3
    assert graphs == []


def test_a_result_it_cannot_rebuild_is_refused():
    """A call whose result holds an object other than tensors, tuples, lists, dataclasses and
    plain values is not replayed (the object would be the captured call's)."""
    with pytest.raises(RuntimeError, match="cannot replay"):
        replay._flatten((torch.zeros(1), object()), [], None)


def test_arguments_round_trip_with_shared_tensors():
    """The signature's structure rebuilds the arguments: dataclasses (frozen or not), tuples,
    values, and one tensor passed twice stays one tensor."""
    x, y = torch.randn(3, 4), torch.randn(5)
    rows = engine.Rows(index=torch.arange(3), n_valid=torch.tensor(3), identity=True)
    args = (x, x, engine.Logits(scale=y, diag_mask=True), rows, (None, 2.5, "a"),
            engine.Wants(col_stats=True))
    leaves: list[torch.Tensor] = []
    spec = replay._flatten(args, leaves, {})
    hash(spec)
    distinct = leaves
    assert len(distinct) == 4  # x once, y, rows.index, rows.n_valid
    copies = [t.clone() for t in distinct]
    back = replay._unflatten(spec, copies)
    assert back[0] is back[1] is copies[0]
    assert back[2] == engine.Logits(scale=copies[1], diag_mask=True)
    assert back[3].index is copies[2] and back[3].identity is True
    assert back[4] == (None, 2.5, "a") and back[5] == args[5]


def test_repeated_elements_get_a_buffer_of_their_own():
    """An expanded argument (stride 0) is copied into a contiguous buffer."""
    g = torch.ones(()).expand(6)
    buffer = replay._buffer(g)
    buffer.copy_(g)
    assert buffer.is_contiguous() and torch.equal(buffer, torch.ones(6))


def test_cache_keeps_the_latest_signatures():
    replay.clear()
    try:
        for i in range(replay.CAPACITY + 3):
            replay._remember(("k", i), replay._SEEN)
        assert len(replay._CACHE) == replay.CAPACITY
        assert ("k", 0) not in replay._CACHE and ("k", replay.CAPACITY + 2) in replay._CACHE
    finally:
        replay.clear()


@requires_cuda
def test_replay_reads_nothing_back(graphs):
    """Captured and replayed steps queue without waiting for the GPU."""
    scale = torch.tensor(10.0, device="cuda", requires_grad=True)
    a, b = _features(0, 256, 64, torch.bfloat16), _features(1, 256, 64, torch.bfloat16)
    _clip_step(a, b, scale)  # compiles, first sight of the signatures
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _clip_step(a, b, scale)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(graphs) == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_replay_on_a_device_that_is_not_current(graphs, tune):
    """Graphs of tensors on cuda:1 capture and replay there while cuda:0 is current, and the
    steps equal the same steps on cuda:0, replayed or not (the kernels launch on the tensors'
    device: launched on the current one, they would read cuda:1's memory from cuda:0)."""
    torch.cuda.set_device(0)
    scale = torch.tensor(10.0, device="cuda:1", requires_grad=True)
    for seed in range(3):
        a, b = (_features(seed + k, 256, 64).detach().to("cuda:1").requires_grad_()
                for k in (0, 10))
        tune(replay_work=1 << 40)
        got = _clip_step(a, b, scale)
        with config.tuned(replay_work=0, split_accumulator=False):
            direct = _clip_step(a, b, scale)
            on_0 = _clip_step(*(t.detach().to("cuda:0").requires_grad_() for t in (a, b, scale)))
        for g, d, w in zip((got[0], *got[1]), (direct[0], *direct[1]), (on_0[0], *on_0[1]),
                           strict=True):
            assert g.device == d.device == torch.device("cuda:1")
            torch.testing.assert_close(g, d, rtol=0, atol=0)
            torch.testing.assert_close(g.to("cuda:0"), w, rtol=0, atol=0)
    assert len(graphs) == 2


def _scaled(x, *, scale):
    return (x * scale,)


def test_keyword_arguments_reach_the_function(graphs):
    """Keyword arguments are part of the signature and reach the captured and replayed call."""
    for k in range(3):
        x = torch.full((4,), float(k), device=DEVICE)
        (out,) = replay.call(_scaled, x, scale=torch.tensor(2.0, device=DEVICE))
        assert torch.equal(out, 2 * x)
    assert len(graphs) == 1


@requires_triton
def test_a_backward_copies_its_saved_operands_once(monkeypatch, graphs, tune):
    """A replayed step copies A and B into the buffers once, for its forward: its backward,
    which autograd hands the same unchanged tensors, reads them there (the gradients as the
    direct step's, exactly)."""
    sources: list[int] = []
    real = torch._foreach_copy_

    def spy(buffers, tensors):
        sources.extend(id(t) for t in tensors)
        return real(buffers, tensors)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    tune(replay_work=1 << 40)
    scale = torch.tensor(10.0, device=DEVICE, requires_grad=True)
    for seed in range(3):  # direct, captured, replayed
        a, b = _features(seed, 48, 32), _features(seed + 10, 48, 32)
        sources.clear()
        got = _clip_step(a, b, scale)
        if seed > 0:  # replayed steps: A and B copied once each
            assert sources.count(id(a)) == sources.count(id(b)) == 1
        with config.tuned(replay_work=0, split_accumulator=False):
            want = _clip_step(a, b, scale)
        for g, w in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@requires_triton
def test_a_backward_after_another_forward_of_its_shapes(graphs, tune):
    """Two losses of the same shapes, both forwards before either backward: the second forward
    fills the buffers that held the first one's A and B, so the first backward copies its own
    again; both steps equal the direct ones, exactly."""
    tune(replay_work=1 << 40)
    scale = torch.tensor(10.0, device=DEVICE, requires_grad=True)
    for seed in range(3):
        pairs = [(_features(seed + k, 48, 32), _features(seed + k + 10, 48, 32)) for k in (0, 5)]
        losses = [fusedloss.clip_loss(a, b, scale, backend="triton") for a, b in pairs]
        got = [torch.autograd.grad(loss, (a, b, scale))
               for loss, (a, b) in zip(losses, pairs, strict=True)]
        with config.tuned(replay_work=0, split_accumulator=False):
            want = [_clip_step(a, b, scale)[1] for a, b in pairs]
        for g, w in zip(got, want, strict=True):
            for x, y in zip(g, w, strict=True):
                torch.testing.assert_close(x, y, rtol=0, atol=0)


@requires_triton
def test_inference_tensors_replay(graphs, tune):
    """Under torch.inference_mode (its tensors keep no version counter) replayed forwards equal
    the direct ones."""
    tune(replay_work=1 << 40)
    with torch.inference_mode():
        scale = torch.tensor(10.0, device=DEVICE)
        for seed in range(3):
            a, b = _features(seed, 48, 32).detach(), _features(seed + 10, 48, 32).detach()
            got = fusedloss.clip_loss(a, b, scale, backend="triton")
            with config.tuned(replay_work=0):
                want = fusedloss.clip_loss(a, b, scale, backend="triton")
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(graphs) == 1


class _FakeGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` that logs its calls (no launches on the CPU);
    a graph captured while ``empty`` is set warns as PyTorch does for a graph without nodes."""

    log: list = []
    empty = False

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.log.append(("begin", pool, capture_error_mode))

    def capture_end(self):
        self.log.append(("end",))
        if _FakeGraph.empty:
            import warnings
            warnings.warn("The CUDA Graph is empty. This usually means that the graph was "
                          "attempted to be captured on wrong device or stream.", stacklevel=1)

    def replay(self):
        self.log.append(("replay", self))


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    _FakeGraph.log, _FakeGraph.empty = [], False
    yield _FakeGraph.log


def test_host_steps_run_at_once_outside_a_capture():
    done = []
    replay.host(lambda: done.append(1))
    assert done == [1]


def test_host_steps_cut_a_capture_and_run_at_each_replay(fake_graphs):
    """During a capture a host step runs nothing: it ends the graph so far and begins the next
    in the same pool; a replay launches the graphs and runs the steps between them, in order,
    once each. A graph captured without launches is left out of the replay."""
    done = []
    tape = replay._Tape()
    tape.begin()
    replay._TAPES.append(tape)
    try:
        replay.host(lambda: done.append("post"))
        _FakeGraph.empty = True  # nothing launched between the two steps
        replay.host(lambda: done.append("wait"))
        _FakeGraph.empty = False
    finally:
        replay._TAPES.pop()
        tape.cut(None)
    assert done == []
    begins = [e for e in fake_graphs if e[0] == "begin"]
    assert len(begins) == 3 and all(e[1:] == ("pool", "thread_local") for e in begins)
    graphs = [g for g, _ in tape.segments]
    assert graphs[0] is not None and graphs[1] is None and graphs[2] is not None
    for _ in range(2):
        fake_graphs.clear()
        tape.run()
        assert [e[1] for e in fake_graphs] == [graphs[0], graphs[2]]
    assert done == ["post", "wait", "post", "wait"]
    assert [a is None for _, a in tape.segments] == [False, False, True]
