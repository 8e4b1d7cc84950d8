"""Every loss works inside ``torch.compile(fullgraph=True)``.

Each public function and module, compiled with ``fullgraph=True``, must give the same loss and
the same gradients (of every differentiable input) as the eager call of the same function: both
run the same custom ops (``fusedloss/ops``), so only rounding may differ. Then:

- ``backend="aot_eager"`` for the whole option grid (``CALLS``), ``"inductor"`` (real CPU
  codegen) for one call per public function, and the library's ``backend="triton"`` (Triton's
  interpreter on the CPU, tiny shapes) under ``aot_eager``;
- no recompilation from one training step to the next at the same shapes (fresh values);
- dynamic shapes: ``dynamic=True``, and ``torch._dynamo.mark_dynamic`` on the token dimension,
  compile once for three sizes;
- whole models (a tiny causal LM, a CLIP-style two-tower model) train identically compiled and
  eager;
- argument errors still reach the user under compile, naming the argument.

Compiles are counted by Dynamo's own statistic ``counters["stats"]["unique_graphs"]``: one per
graph Dynamo compiles (one per compile under ``fullgraph=True``), cleared with Dynamo's caches
before every test. (``torch._dynamo.testing.CompileCounterWithBackend`` counts calls of the
backend instead, which double-counts a compile that Dynamo restarts, as it does under
``dynamic=True`` when a Python float option becomes symbolic.) ``test_counter_counts_recompiles``
checks that the statistic does see a recompilation.
"""

from __future__ import annotations

import copy
import math
import re
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from helpers import ON_GPU, counting_training_path
from torch import nn
from torch._dynamo.utils import counters

import fusedloss

N, D, V = 13, 24, 37  # tokens / pairs, width, vocabulary
M = 29  # InfoNCE keys (M > N: a queue of negatives)
B, T = 3, 7  # batch and time of the shifted (causal LM) input
RTOL = ATOL = 1e-5  # same kernels compiled and eager: rounding-level differences only
STEPS = 3

LCE = fusedloss.linear_cross_entropy


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch (and leaves no cached graphs behind)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _compiles() -> int:
    """Graphs Dynamo compiled since the test began (restarted analyses are not counted)."""
    return counters["stats"]["unique_graphs"]


# ---------------------------------------------------------------------------------------------
# inputs: make(seed, device) -> the positional arguments of a call; a new seed is a new step


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _lm(seed, device, *, lead=(N,), v=V, d=D, bias=False, class_weight=False, ignore=None,
        order=False):
    """(input, linear_weight, target[, linear_bias][, class weights][, vocab order]).

    ``ignore``: an ignore_index to put in about a third of the targets (the first one always)."""
    g = _gen(seed)
    h = torch.randn(*lead, d, generator=g)
    w = 2.0 * torch.randn(v, d, generator=g) / math.sqrt(d)
    y = torch.randint(0, v, lead, generator=g)
    if ignore is not None:
        y = torch.where(torch.rand(lead, generator=g) < 0.3, ignore, y)
        y.view(-1)[0] = ignore
    args = [h.to(device).requires_grad_(), w.to(device).requires_grad_(), y.to(device)]
    if bias:
        args.append((0.5 * torch.randn(v, generator=g)).to(device).requires_grad_())
    if class_weight:
        args.append((torch.rand(v, generator=g) + 0.25).to(device))
    if order:
        args.append(torch.randperm(v, generator=g).to(device))
    return tuple(args)


def _unit(g, rows, d=D, device="cpu"):
    """Unit feature rows that require gradients."""
    return F.normalize(torch.randn(rows, d, generator=g), dim=1).to(device).requires_grad_()


def _param(value, device):
    """A learnable scalar (logit scale or bias, temperature)."""
    return torch.full((), float(value), device=device, requires_grad=True)


def _pair(seed, device, *, n=N, d=D, scale=None, bias=None):
    """(image_features, text_features[, logit_scale tensor][, logit_bias tensor])."""
    g = _gen(seed)
    args = [_unit(g, n, d, device), _unit(g, n, d, device)]
    jitter = 1.0 + 0.1 * torch.rand((), generator=g).item()  # a new value every step
    if scale is not None:
        args.append(_param(scale * jitter, device))
    if bias is not None:
        args.append(_param(bias * jitter, device))
    return tuple(args)


def _queries(seed, device, *, n=N, m=M, d=D, labels=False, temperature=None):
    """(query, keys[, labels][, temperature tensor])."""
    g = _gen(seed)
    args = [_unit(g, n, d, device), _unit(g, m, d, device)]
    if labels:
        args.append(torch.randint(0, m, (n,), generator=g).to(device))
    if temperature is not None:
        jitter = 1.0 + 0.1 * torch.rand((), generator=g).item()
        args.append(_param(temperature * jitter, device))
    return tuple(args)


def _views(seed, device, *, n=N, d=D, temperature=None, stacked=True):
    """(features (2n, D)[, temperature tensor]), or the two views (z1, z2) unstacked."""
    g = _gen(seed)
    z1, z2 = _unit(g, n, d, device), _unit(g, n, d, device)
    if not stacked:
        return z1, z2
    feats = torch.cat([z1, z2]).detach().requires_grad_()
    if temperature is None:
        return (feats,)
    jitter = 1.0 + 0.1 * torch.rand((), generator=g).item()
    return feats, _param(temperature * jitter, device)


# ---------------------------------------------------------------------------------------------
# the calls: id -> (make, fn); fn is a function of make's arguments, or a module


_CLASS_WEIGHT = torch.rand(V, generator=_gen(7)) + 0.25
_CLIP_SUM = fusedloss.ClipLoss(reduction="sum")
_ALL = dict(reduction="sum", label_smoothing=0.1, softcap=2.5, z_loss=1e-3, shift=True,
            filter_eps=1e-3, return_lse=True, ignore_index=-1)

CALLS = {
    # linear_cross_entropy: every option
    "lce": (_lm, lambda h, w, y: LCE(h, w, y)),
    "lce-bias": (partial(_lm, bias=True), lambda h, w, y, b: LCE(h, w, y, linear_bias=b)),
    "lce-class-weight": (partial(_lm, class_weight=True),
                         lambda h, w, y, cw: LCE(h, w, y, weight=cw)),
    "lce-reduction=none": (_lm, lambda h, w, y: LCE(h, w, y, reduction="none")),
    "lce-reduction=sum": (_lm, lambda h, w, y: LCE(h, w, y, reduction="sum")),
    "lce-ignored": (partial(_lm, ignore=-100), lambda h, w, y: LCE(h, w, y)),
    "lce-ignore-index=-1": (partial(_lm, ignore=-1),
                            lambda h, w, y: LCE(h, w, y, ignore_index=-1)),
    "lce-class-weight-ignored": (partial(_lm, class_weight=True, ignore=-100),
                                 lambda h, w, y, cw: LCE(h, w, y, weight=cw)),
    "lce-label-smoothing": (_lm, lambda h, w, y: LCE(h, w, y, label_smoothing=0.1)),
    "lce-softcap": (_lm, lambda h, w, y: LCE(h, w, y, softcap=2.5)),
    "lce-z-loss": (_lm, lambda h, w, y: LCE(h, w, y, z_loss=1e-2)),
    "lce-shift": (partial(_lm, lead=(B, T)), lambda h, w, y: LCE(h, w, y, shift=True)),
    "lce-return-lse": (_lm, lambda h, w, y: LCE(h, w, y, return_lse=True)),
    "lce-return-lse-reduction=none": (
        partial(_lm, ignore=-100), lambda h, w, y: LCE(h, w, y, return_lse=True, reduction="none")),
    "lce-filter-eps=1e-3": (_lm, lambda h, w, y: LCE(h, w, y, filter_eps=1e-3)),
    "lce-filter-eps=None": (_lm, lambda h, w, y: LCE(h, w, y, filter_eps=None)),
    "lce-vocab-order": (partial(_lm, order=True),
                        lambda h, w, y, o: LCE(h, w, y, vocab_order=o)),
    "lce-all-options": (
        partial(_lm, lead=(B, T), bias=True, class_weight=True, ignore=-1, order=True),
        lambda h, w, y, b, cw, o: LCE(h, w, y, linear_bias=b, weight=cw, vocab_order=o, **_ALL)),
    "module-lce": (partial(_lm, bias=True), fusedloss.LinearCrossEntropyLoss()),
    "module-lce-options": (
        partial(_lm, lead=(B, T), ignore=-100),
        fusedloss.LinearCrossEntropyLoss(_CLASS_WEIGHT, label_smoothing=0.1, z_loss=1e-3,
                                         softcap=2.5, shift=True, return_lse=True)),
    # clip_loss
    "clip": (_pair, lambda a, b: fusedloss.clip_loss(a, b, 1 / 0.07)),
    "clip-tensor-scale": (partial(_pair, scale=14.0),
                          lambda a, b, s: fusedloss.clip_loss(a, b, s)),
    "clip-tensor-scale-bias": (partial(_pair, scale=14.0, bias=-2.0),
                               lambda a, b, s, c: fusedloss.clip_loss(a, b, s, c)),
    "clip-reduction=none": (partial(_pair, scale=14.0),
                            lambda a, b, s: fusedloss.clip_loss(a, b, s, reduction="none")),
    "clip-reduction=sum": (partial(_pair, scale=14.0),
                           lambda a, b, s: fusedloss.clip_loss(a, b, s, reduction="sum")),
    "clip-filter-eps=1e-3": (partial(_pair, scale=14.0),
                             lambda a, b, s: fusedloss.clip_loss(a, b, s, filter_eps=1e-3)),
    "module-clip": (partial(_pair, scale=14.0), fusedloss.ClipLoss()),
    "module-clip-sum-output-dict": (
        partial(_pair, scale=14.0, bias=-2.0),
        lambda a, b, s, c: _CLIP_SUM(a, b, s, c, output_dict=True)),
    # info_nce_loss
    "info-nce": (partial(_queries, m=N), lambda q, k: fusedloss.info_nce_loss(q, k,
                                                                              temperature=0.1)),
    "info-nce-keys-M>N": (_queries, lambda q, k: fusedloss.info_nce_loss(q, k, temperature=0.1)),
    "info-nce-labels": (partial(_queries, labels=True),
                        lambda q, k, y: fusedloss.info_nce_loss(q, k, y, temperature=0.1)),
    "info-nce-tensor-temperature": (
        partial(_queries, labels=True, temperature=0.1),
        lambda q, k, y, t: fusedloss.info_nce_loss(q, k, y, temperature=t, reduction="sum")),
    "info-nce-reduction=none": (
        partial(_queries, temperature=0.1),
        lambda q, k, t: fusedloss.info_nce_loss(q, k, temperature=t, reduction="none")),
    "module-info-nce": (partial(_queries, labels=True), fusedloss.InfoNCELoss(0.1)),
    # nt_xent_loss
    "nt-xent": (_views, lambda z: fusedloss.nt_xent_loss(z, 0.5)),
    "nt-xent-tensor-temperature": (partial(_views, temperature=0.5),
                                   lambda z, t: fusedloss.nt_xent_loss(z, t)),
    "nt-xent-reduction=none": (partial(_views, temperature=0.5),
                               lambda z, t: fusedloss.nt_xent_loss(z, t, reduction="none")),
    "nt-xent-reduction=sum": (_views, lambda z: fusedloss.nt_xent_loss(z, 0.5, reduction="sum")),
    "module-nt-xent-two-views": (partial(_views, stacked=False), fusedloss.NTXentLoss(0.5)),
    "module-nt-xent": (_views, fusedloss.NTXentLoss(0.2, reduction="sum")),
    # siglip_loss
    "siglip": (_pair, lambda a, b: fusedloss.siglip_loss(a, b, 10.0, -10.0)),
    "siglip-tensor-scale-bias": (partial(_pair, scale=10.0, bias=-10.0),
                                 lambda a, b, s, c: fusedloss.siglip_loss(a, b, s, c)),
    "module-siglip": (partial(_pair, scale=10.0, bias=-10.0), fusedloss.SigLipLoss()),
}

# Inductor compiles slowly on a small CPU: one call per public function, with its options.
INDUCTOR_CALLS = ["lce-all-options", "clip-tensor-scale-bias", "info-nce-tensor-temperature",
                  "nt-xent-tensor-temperature", "siglip-tensor-scale-bias"]

# The library's backend="triton" (Triton's interpreter on the CPU): tiny shapes.
NT, DT, VT = 9, 16, 20
TRITON_CALLS = {
    "lce-triton-filtered-auto-order": (
        partial(_lm, lead=(NT,), v=VT, d=DT, bias=True, ignore=-100),
        lambda h, w, y, b: LCE(h, w, y, linear_bias=b, filter_eps=1e-3, vocab_order="auto",
                               return_lse=True, backend="triton")),
    "lce-triton-shift-options": (
        partial(_lm, lead=(2, 5), v=VT, d=DT, class_weight=True, order=True),
        lambda h, w, y, cw, o: LCE(h, w, y, weight=cw, vocab_order=o, shift=True, softcap=2.5,
                                   label_smoothing=0.1, z_loss=1e-3, backend="triton")),
    "clip-triton": (partial(_pair, n=NT, d=DT, scale=14.0),
                    lambda a, b, s: fusedloss.clip_loss(a, b, s, filter_eps=1e-3,
                                                        backend="triton")),
    "info-nce-triton": (partial(_queries, n=NT, m=NT + 4, d=DT, labels=True, temperature=0.1),
                        lambda q, k, y, t: fusedloss.info_nce_loss(q, k, y, temperature=t,
                                                                   backend="triton")),
    "nt-xent-triton": (partial(_views, n=5, d=DT, temperature=0.5),
                       lambda z, t: fusedloss.nt_xent_loss(z, t, backend="triton")),
    "siglip-triton": (partial(_pair, n=NT, d=DT, scale=10.0, bias=-10.0),
                      lambda a, b, s, c: fusedloss.siglip_loss(a, b, s, c, backend="triton")),
    # the contrastive losses' small-size path (its own op, fusedloss::contrastive_materialized)
    "clip-materialized": (partial(_pair, n=NT, d=DT, scale=14.0),
                          lambda a, b, s: fusedloss.clip_loss(a, b, s,
                                                              backend="materialized")),
    "info-nce-materialized": (
        partial(_queries, n=NT, m=NT + 4, d=DT, labels=True, temperature=0.1),
        lambda q, k, y, t: fusedloss.info_nce_loss(q, k, y, temperature=t,
                                                   backend="materialized")),
    "nt-xent-materialized": (partial(_views, n=5, d=DT, temperature=0.5),
                             lambda z, t: fusedloss.nt_xent_loss(z, t, backend="materialized")),
    "siglip-materialized": (partial(_pair, n=NT, d=DT, scale=10.0, bias=-10.0),
                            lambda a, b, s, c: fusedloss.siglip_loss(a, b, s, c,
                                                                     backend="materialized")),
}


# ---------------------------------------------------------------------------------------------
# comparison


def _as_scalar_loss(out):
    """One scalar from a call's output(s), weighting every element differently, so that every
    output (the loss, per-token losses, the LSE) sends a gradient of its own."""
    if isinstance(out, dict):
        out = tuple(out.values())
    parts = out if isinstance(out, tuple) else (out,)
    total = 0.0
    for i, t in enumerate(parts, start=1):
        weights = torch.linspace(0.5, 1.5, t.numel(), device=t.device).view_as(t)
        total = total + i * (t * weights).sum()
    return total


def _loss_and_grads(fn, args):
    """The call's output and the gradients of every input that requires them."""
    out = fn(*args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(_as_scalar_loss(out), leaves)
    detached = {k: v.detach() for k, v in out.items()} if isinstance(out, dict) else \
        tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()
    return detached, grads


def _assert_same(compiled, eager, args, *, rtol=RTOL, atol=ATOL, what=""):
    out, grads = _loss_and_grads(compiled, args)
    ref_out, ref_grads = _loss_and_grads(eager, args)
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what} output differs from eager: {m}")
    assert len(grads) == len(ref_grads)
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        torch.testing.assert_close(g, r, rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"{what} gradient {i} differs: {m}")


def _on(fn, device):
    return fn.to(device) if isinstance(fn, nn.Module) else fn


def _check_compiled(table, name, device, backend, *, steps=1, rtol=RTOL, atol=ATOL):
    """Compiles table[name] with ``backend``, compares ``steps`` fresh-input calls with eager
    and returns the number of compiles."""
    make, fn = table[name]
    fn = _on(fn, device)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for step in range(steps):
        _assert_same(compiled, fn, make(step, device), rtol=rtol, atol=atol, what=f"step {step}:")
    return _compiles()


# ---------------------------------------------------------------------------------------------
# 1, 2: compiled equals eager


@pytest.mark.parametrize("name", list(CALLS))
def test_aot_eager_matches_eager(name, device):
    assert _check_compiled(CALLS, name, device, "aot_eager") == 1


@pytest.mark.slow  # inductor compiles on the CPU: make test-slow (aot_eager above in make test)
@pytest.mark.parametrize("name", INDUCTOR_CALLS)
def test_inductor_matches_eager(name, device):
    assert _check_compiled(CALLS, name, device, "inductor") == 1


@pytest.mark.parametrize("name", list(TRITON_CALLS))
def test_triton_backend_compiled_matches_eager(name, device, requires_triton):
    assert _check_compiled(TRITON_CALLS, name, device, "aot_eager") == 1


def test_triton_backward_in_row_blocks_compiled_matches_eager(device, requires_triton,
                                                              monkeypatch):
    """The LM head's engine backward in blocks of rows (``ops._common.backward_row_chunk``, 16
    rows here) runs inside the op: compiled with fullgraph=True it gives eager's loss and
    gradients, and each backward ran in more than one block (one record per block)."""
    from fusedloss.core import engine
    from fusedloss.ops import cross_entropy as ops

    monkeypatch.setattr(ops, "backward_row_chunk", lambda a: 16)
    table = {"lce-triton-row-blocks": (
        # more rows than one block of the backward's tiles (16 here, 128 or more on a GPU)
        partial(_lm, lead=(600,) if ON_GPU else (48,), v=VT, d=DT, bias=True, ignore=-100),
        # per-token losses: the engine's backward (a reduced loss takes the training path)
        lambda h, w, y, b: LCE(h, w, y, linear_bias=b, label_smoothing=0.1, reduction="none",
                               backend="triton").sum())}
    with engine.recording_backward_tiles() as record:
        assert _check_compiled(table, "lce-triton-row-blocks", device, "aot_eager") == 1
    assert len(record) > 2  # two backward calls, compiled and eager, in blocks


@pytest.mark.parametrize("rows", [16, pytest.param(None, marks=pytest.mark.slow)],
                         ids=["in-forward", "deferred"])
def test_triton_training_path_compiled_matches_eager(device, requires_triton, rows):
    """The LM head's training path (``core.chunked_logits``): in chunks of 16 rows with the
    gradient formed in the forward, or for these 60 rows in the backward (the policy's);
    compiled with fullgraph=True it gives eager's loss and gradients under "mean" and "sum",
    and the path ran in each call (the deferred form twice: forward and backward)."""
    table = {f"lce-{reduction}": (
        partial(_lm, lead=(3, 20), v=VT, d=DT, bias=True, class_weight=True, ignore=-100),
        lambda h, w, y, b, cw, reduction=reduction: LCE(
            h, w, y, linear_bias=b, weight=cw, softcap=5.0, z_loss=1e-3, shift=True,
            reduction=reduction, backend="triton") * 0.37)
        for reduction in ("mean", "sum")}
    with counting_training_path("loss_and_grads", rows=rows) as calls:
        for name in table:
            assert _check_compiled(table, name, device, "aot_eager") == 1
            counters.clear()
    assert len(calls) == (4 if rows else 8)  # compiled and eager, two reductions


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_training_path_replays_as_cuda_graphs():
    """The LM head's training path reads nothing back to the host and carries no
    cudagraph_unsafe tag: under ``torch.compile(mode="reduce-overhead")`` a step of a small
    model with the loss inside is captured (Inductor skips no graph) and its replays give the
    eager steps' losses and gradients, on fresh inputs each step."""
    def make(n, d):
        return torch.randn(n, d, device="cuda"), _targets_with_ignored(n)

    def loss_of(body, head, x, y):
        return fusedloss.linear_cross_entropy(body(x), head, y, label_smoothing=0.1,
                                              backend="triton")

    _assert_replays_match_eager(nn.Sequential(nn.Linear(64, 64), nn.GELU()), make, loss_of,
                                loss_tol=(1e-5, 1e-6), grad_tol=(1e-4, 1e-6))


def _assert_replays_match_eager(body, make, loss_fn, loss_tol, grad_tol):
    """``loss_fn(body, head, *make(n, d))`` under ``torch.compile(mode="reduce-overhead")``
    over four steps on fresh inputs: each step's loss and head gradient match an eager twin's
    within (rtol, atol), and Inductor skipped no CUDA graph."""
    torch.manual_seed(0)
    v, d, n = 1000, 64, 256
    body = body.cuda()
    head = nn.Parameter(torch.randn(v, d, device="cuda") / 8)
    twin_body, twin_head = copy.deepcopy(body), nn.Parameter(head.detach().clone())
    compiled = torch.compile(loss_fn, mode="reduce-overhead")
    counters.clear()
    for _ in range(4):
        x, y = make(n, d)
        got = compiled(body, head, x, y)
        got.backward()
        want = loss_fn(twin_body, twin_head, x, y)
        want.backward()
        torch.testing.assert_close(got, want, rtol=loss_tol[0], atol=loss_tol[1])
        torch.testing.assert_close(head.grad, twin_head.grad, rtol=grad_tol[0],
                                   atol=grad_tol[1])
        for p in (head, twin_head, *body.parameters(), *twin_body.parameters()):
            p.grad = None
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


# A small model's step with an engine op inside: (make the step's inputs, the loss).
GRAPHED_STEPS = {
    "clip": (lambda n, d: (torch.randn(n, d, device="cuda"), torch.randn(n, d, device="cuda")),
             lambda body, head, x, y: fusedloss.clip_loss(
                 F.normalize(body(x), dim=1), F.normalize(y @ head[:64].T, dim=1), 14.0,
                 backend="triton")),
    "info-nce-labels": (
        lambda n, d: (torch.randn(n, d, device="cuda"),
                      torch.randint(0, 1000, (n,), device="cuda")),
        lambda body, head, x, y: fusedloss.info_nce_loss(body(x), head, y, temperature=0.5,
                                                         backend="triton")),
    "lm-head-per-token": (
        lambda n, d: (torch.randn(n, d, device="cuda"), _targets_with_ignored(n)),
        lambda body, head, x, y: fusedloss.linear_cross_entropy(
            body(x), head, y, reduction="none", backend="triton").mean()),
}


def _targets_with_ignored(n: int) -> torch.Tensor:
    y = torch.randint(0, 1000, (n,), device="cuda")
    y[::9] = -100
    return y


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", list(GRAPHED_STEPS))
def test_engine_ops_replay_as_cuda_graphs(name):
    """The engine's ops read nothing back to the host with default options and carry no
    cudagraph_unsafe tag: a small model's step with CLIP, InfoNCE with labels or the LM head's
    per-token losses inside is captured under ``mode="reduce-overhead"`` (Inductor skips no
    graph), and its replays give the eager steps' losses and gradients on fresh inputs."""
    make, loss_fn = GRAPHED_STEPS[name]
    body = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    _assert_replays_match_eager(body, make, loss_fn, loss_tol=(1e-4, 1e-5),
                                grad_tol=(1e-3, 1e-5))


# ---------------------------------------------------------------------------------------------
# 3: no recompilation between training steps


def test_counter_counts_recompiles(device):
    """The count sees a recompilation: a new shape under dynamic=False recompiles, new values at
    the same shape do not (plain PyTorch, independent of the library)."""
    fn = torch.compile(lambda h, w, y: F.cross_entropy(h @ w.T, y), fullgraph=True,
                       backend="aot_eager", dynamic=False)
    for seed, n in enumerate((N, N, N + 4)):
        fn(*_lm(seed, device, lead=(n,))).backward()
    assert _compiles() == 2


@pytest.mark.parametrize("name", list(CALLS))
def test_no_recompile_across_steps(name, device):
    """Three training steps at one shape with new values compile once."""
    compiles = _check_compiled(CALLS, name, device, "aot_eager", steps=STEPS)
    assert compiles == 1, f"{compiles} compiles for {STEPS} same-shape steps"


# ---------------------------------------------------------------------------------------------
# 4: dynamic shapes

# id -> (make(n, seed, device), fn, [(argument index, dimension)] that vary with n)
DYNAMIC_CALLS = {
    "lce": (lambda n, s, dev: _lm(s, dev, lead=(n,), bias=True),
            lambda h, w, y, b: LCE(h, w, y, linear_bias=b), [(0, 0), (2, 0)]),
    "lce-shift-return-lse": (lambda n, s, dev: _lm(s, dev, lead=(2, n), ignore=-100),
                             lambda h, w, y: LCE(h, w, y, shift=True, return_lse=True),
                             [(0, 1), (2, 1)]),
    "clip": (lambda n, s, dev: _pair(s, dev, n=n, scale=14.0),
             lambda a, b, s: fusedloss.clip_loss(a, b, s), [(0, 0), (1, 0)]),
    "info-nce-labels": (lambda n, s, dev: _queries(s, dev, n=n, m=n + 6, labels=True),
                        lambda q, k, y: fusedloss.info_nce_loss(q, k, y, temperature=0.1),
                        [(0, 0), (1, 0), (2, 0)]),
    "nt-xent": (lambda n, s, dev: _views(s, dev, n=n, temperature=0.5),
                lambda z, t: fusedloss.nt_xent_loss(z, t), [(0, 0)]),
}
SIZES = (11, 17, 23)


@pytest.mark.parametrize("mode", ["dynamic=True", "mark_dynamic"])
@pytest.mark.parametrize("name", list(DYNAMIC_CALLS))
def test_dynamic_shapes_compile_once(name, mode, device):
    make, fn, dims = DYNAMIC_CALLS[name]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager",
                             dynamic=True if mode == "dynamic=True" else None)
    for step, n in enumerate(SIZES):
        args = make(n, step, device)
        if mode == "mark_dynamic":
            for index, dim in dims:
                torch._dynamo.mark_dynamic(args[index], dim)
        _assert_same(compiled, fn, args, what=f"size {n}:")
    assert _compiles() == 1, f"{_compiles()} compiles for sizes {SIZES}"


# ---------------------------------------------------------------------------------------------
# 5: whole models


class TinyCausalLM(nn.Module):
    """Embedding, one attention-free residual MLP block, a final norm, and the LM head's loss."""

    def __init__(self, vocab: int = V, width: int = D) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        hidden = self.norm(x + self.mlp(x))
        return fusedloss.linear_cross_entropy(hidden, self.lm_head.weight, labels, shift=True)


class TwoTower(nn.Module):
    """Two linear encoders, L2-normalized features, a learnable log logit scale, ClipLoss."""

    def __init__(self, image_dim: int = 20, text_dim: int = 16, width: int = D) -> None:
        super().__init__()
        self.image = nn.Linear(image_dim, width)
        self.text = nn.Linear(text_dim, width)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.loss = fusedloss.ClipLoss()

    def forward(self, images, texts):
        img = F.normalize(self.image(images), dim=-1)
        txt = F.normalize(self.text(texts), dim=-1)
        return self.loss(img, txt, self.logit_scale.exp())


def _lm_batch(step, device):
    g = _gen(100 + step)
    tokens = torch.randint(0, V, (B, T + 2), generator=g).to(device)
    return tokens, tokens  # predict the next token of the same sequence


def _pair_batch(step, device):
    g = _gen(200 + step)
    return torch.randn(N, 20, generator=g).to(device), torch.randn(N, 16, generator=g).to(device)


MODELS = {"causal-lm": (TinyCausalLM, _lm_batch), "two-tower": (TwoTower, _pair_batch)}


def _train(model, batches, steps=STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = model(*batches(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _check_training(name, device, backend, *, rtol=RTOL, atol=ATOL):
    make_model, make_batch = MODELS[name]
    torch.manual_seed(0)
    eager = make_model().to(device)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    batches = partial(make_batch, device=device)
    losses = _train(compiled, batches)
    ref_losses = _train(eager, batches)
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=atol)
    assert not torch.equal(losses[0], losses[-1])  # it did train
    params = dict(model.named_parameters())
    for key, ref in eager.named_parameters():
        torch.testing.assert_close(params[key], ref, rtol=rtol, atol=atol,
                                   msg=lambda m, key=key: f"parameter {key}: {m}")
    assert _compiles() == 1, f"{_compiles()} compiles for {STEPS} steps"


@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_like_eager_aot_eager(name, device):
    _check_training(name, device, "aot_eager")


@pytest.mark.slow
def test_causal_lm_trains_like_eager_inductor(device):
    """~5 s in a full run; ~25 s alone, which pays Inductor's one-time C++ warm-up."""
    _check_training("causal-lm", device, "inductor")


# ---------------------------------------------------------------------------------------------
# 6: errors under compile


# id -> (fn, make(device), expected type, message): detectable from shapes and dtypes
SHAPE_ERRORS = {
    "lce-weight-dtype": (
        lambda h, w, y: LCE(h, w, y),
        lambda dev: (torch.randn(N, D, device=dev), torch.randn(V, D, device=dev).double(),
                     torch.zeros(N, dtype=torch.long, device=dev)),
        TypeError, "linear_weight has dtype torch.float64 but input has torch.float32"),
    "lce-target-shape": (
        lambda h, w, y: LCE(h, w, y),
        lambda dev: (torch.randn(N, D, device=dev), torch.randn(V, D, device=dev),
                     torch.zeros(N - 1, dtype=torch.long, device=dev)),
        ValueError, "target must have shape input.shape[:-1]"),
    "clip-shape-mismatch": (
        lambda a, b: fusedloss.clip_loss(a, b, 10.0),
        lambda dev: (torch.randn(N, D, device=dev), torch.randn(N + 1, D, device=dev)),
        ValueError, "image_features and text_features must have the same shape"),
    "nt-xent-odd-rows": (
        lambda z: fusedloss.nt_xent_loss(z, 0.5),
        lambda dev: (torch.randn(N, D, device=dev),),
        ValueError, "odd number of rows"),
}


def _assert_user_error(excinfo, expected_type):
    """The error the user sees: the original type, or Dynamo's wrapper of a user exception
    raised while tracing under fullgraph=True (``Unsupported: Observed exception``), whose
    message names the original type and repeats its message."""
    err = excinfo.value
    if not isinstance(err, expected_type):
        assert isinstance(err, torch._dynamo.exc.Unsupported), repr(err)
        assert f"{expected_type.__name__}(" in str(err), str(err)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks-allowed"])
@pytest.mark.parametrize("name", list(SHAPE_ERRORS))
def test_argument_errors_under_compile(name, fullgraph, device):
    fn, make, expected, message = SHAPE_ERRORS[name]
    with pytest.raises(expected, match=re.escape(message)):
        fn(*make(device))  # eager
    compiled = torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")
    with pytest.raises((expected, torch._dynamo.exc.Unsupported),
                       match=re.escape(message)) as excinfo:
        compiled(*make(device))
    if fullgraph:
        _assert_user_error(excinfo, expected)
    else:  # Dynamo falls back to eager around the raise: the user's own exception
        assert type(excinfo.value) is expected


# id -> (fn, make(device), message): found only from tensor values, inside the ops
VALUE_ERRORS = {
    "lce-target-equals-V": (
        lambda h, w, y: LCE(h, w, y),
        lambda dev: (torch.randn(N, D, device=dev, requires_grad=True),
                     torch.randn(V, D, device=dev, requires_grad=True),
                     torch.full((N,), V, dtype=torch.long, device=dev)),
        "target"),
    "lce-negative-target": (
        lambda h, w, y: LCE(h, w, y),
        lambda dev: (torch.randn(N, D, device=dev), torch.randn(V, D, device=dev),
                     torch.full((N,), -3, dtype=torch.long, device=dev)),
        "target"),
    "info-nce-label-out-of-range": (
        lambda q, k, y: fusedloss.info_nce_loss(q, k, y),
        lambda dev: (torch.randn(N, D, device=dev), torch.randn(M, D, device=dev),
                     torch.full((N,), M, dtype=torch.long, device=dev)),
        "labels"),
}


@pytest.mark.parametrize("name", list(VALUE_ERRORS))
def test_value_errors_under_compile(name, device, tune):
    # The LM head's training path (CUDA, gradients wanted) gives NaN for a bad target unless
    # asked to check: its check is the opt-in one wait for the GPU.
    tune(check_values=True)
    fn, make, word = VALUE_ERRORS[name]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=word) as excinfo:  # the op's error, maybe wrapped
        compiled(*make(device))
    assert isinstance(excinfo.value, (ValueError, RuntimeError)), repr(excinfo.value)
