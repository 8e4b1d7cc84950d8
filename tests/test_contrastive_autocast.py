"""The contrastive losses under ``torch.autocast``: their features are cast to the autocast
dtype, as the matmul of the plain PyTorch formula would cast them; the scale, temperature and
bias stay fp32 scalars; the loss is fp32.

So under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a call with fp32 features must give
what the same call gives outside autocast with the features cast to bf16: the value and every
gradient, which arrive in fp32 on fp32 leaves. That holds for the functional losses, their
modules, under ``torch.compile(fullgraph=True)``, on Triton's kernels and on the ring. The ops'
bodies run with autocast off: their fp32 products, rounded to bf16, would take the loss ~1e-3
away from the float64 reference, where the fp32 products stay within 1e-5. Outside autocast,
features of two dtypes are a TypeError naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import triton_interpreter_enabled
from workers import Raised, all_ok

import fusedloss.distributed as fd
from fusedloss import (
    ClipLoss,
    InfoNCELoss,
    NTXentLoss,
    SigLipLoss,
    clip_loss,
    info_nce_loss,
    nt_xent_loss,
    reference,
    siglip_loss,
)

B, M, D = 6, 9, 8  # pairs / queries, keys, width
BF16 = torch.bfloat16


def autocast():
    return torch.autocast("cpu", dtype=BF16)


def unit(rows: int, seed: int, width: int = D) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, width, generator=g), dim=1)


LABELS = torch.tensor([3, 0, 8, 1, 1, 5])  # info_nce: (B,) into M keys


@dataclass
class Case:
    """A call ``fn(**inputs)``; ``features``: which inputs are feature matrices (cast under
    autocast), the others are scalars (stay fp32)."""

    inputs: dict
    features: tuple[str, ...]
    fn: object
    ref: object = None  # the float64 reference of the same call, where one is written

    def leaves(self) -> dict:
        return {k: v.clone().requires_grad_() for k, v in self.inputs.items()}


def pair(**scalars) -> dict:
    return dict(i=unit(B, 0), t=unit(B, 1), **{k: torch.tensor(v) for k, v in scalars.items()})


CASES = {
    "clip": Case(pair(s=10.3), ("i", "t"), lambda i, t, s: clip_loss(i, t, s),
                 lambda i, t, s: reference.clip_loss_ref(i, t, s)),
    "siglip": Case(pair(s=10.3, c=-4.1), ("i", "t"), lambda i, t, s, c: siglip_loss(i, t, s, c),
                   lambda i, t, s, c: reference.siglip_loss_ref(i, t, s, c)),
    "info_nce": Case(dict(q=unit(B, 2), k=unit(M, 3), tau=torch.tensor(0.1)), ("q", "k"),
                     lambda q, k, tau: info_nce_loss(q, k, LABELS, temperature=tau),
                     lambda q, k, tau: reference.info_nce_loss_ref(q, k, LABELS, temperature=tau)),
    "nt_xent": Case(dict(z=unit(2 * B, 4), tau=torch.tensor(0.45)), ("z",),
                    lambda z, tau: nt_xent_loss(z, tau),
                    lambda z, tau: reference.nt_xent_loss_ref(z, tau)),
    "module-clip": Case(pair(s=10.3), ("i", "t"), lambda i, t, s: ClipLoss()(i, t, s)),
    "module-siglip": Case(pair(s=10.3, c=-4.1), ("i", "t"),
                          lambda i, t, s, c: SigLipLoss()(i, t, s, c)),
    "module-info_nce": Case(dict(q=unit(B, 2), k=unit(M, 3)), ("q", "k"),
                            lambda q, k: InfoNCELoss(0.1)(q, k, LABELS)),
    "module-nt_xent": Case(dict(z=unit(2 * B, 4)), ("z",), lambda z: NTXentLoss(0.5)(z)),
    "module-nt_xent-two-views": Case(dict(z1=unit(B, 5), z2=unit(B, 6)), ("z1", "z2"),
                                     lambda z1, z2: NTXentLoss(0.5)(z1, z2)),
}
FUNCTIONAL = ["clip", "siglip", "info_nce", "nt_xent"]


def run(case: Case, fn=None, *, under_autocast: bool) -> tuple[torch.Tensor, list]:
    """(loss, gradients of its fp32 leaves). Under autocast the fp32 features go in and the
    backward runs inside the region too (on the CPU it runs on this thread, autocast on);
    outside, the features are cast to bf16 by hand."""
    fn = fn or case.fn
    leaves = case.leaves()
    if under_autocast:
        with autocast():
            loss = fn(**leaves)
            grads = torch.autograd.grad(loss, list(leaves.values()))
    else:
        loss = fn(**{k: v.to(BF16) if k in case.features else v for k, v in leaves.items()})
        grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.detach(), list(grads)


def assert_same(got, want) -> None:
    (loss, grads), (want_loss, want_grads) = got, want
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want_loss)
    for g, w in zip(grads, want_grads, strict=True):
        assert g.dtype == torch.float32  # on the fp32 leaves
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("name", list(CASES))
def test_autocast_casts_the_features(name):
    case = CASES[name]
    assert_same(run(case, under_autocast=True), run(case, under_autocast=False))


@pytest.mark.parametrize("name", FUNCTIONAL)
def test_the_ops_run_with_autocast_off(name):
    """Against the float64 reference of the bf16-rounded features: the loss and the scalar's
    gradient keep fp32 accuracy (bf16-rounded internal products give errors ~1e-3), the
    features' gradients are the reference's to within their final rounding to bf16."""
    case = CASES[name]
    loss, grads = run(case, under_autocast=True)
    leaves = {k: (v.to(BF16) if k in case.features else v).double().requires_grad_()
              for k, v in case.inputs.items()}
    ref = case.ref(**leaves)
    ref_grads = torch.autograd.grad(ref, list(leaves.values()))
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=0)
    for (k, g), r in zip(zip(leaves, grads, strict=True), ref_grads, strict=True):
        if k in case.features:  # bf16's unit roundoff is 2^-8; 2^-7 allows one ulp
            torch.testing.assert_close(g.double(), r, rtol=2**-7, atol=1e-6, msg=k)
        else:
            torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("name", list(CASES))
def test_autocast_under_compile(name):
    """The cast is traced into the graph (fullgraph): the compiled call, made under autocast,
    gives the eager call's result on bf16 features."""
    case = CASES[name]
    compiled = torch.compile(case.fn, fullgraph=True, backend="aot_eager")
    assert_same(run(case, compiled, under_autocast=True), run(case, under_autocast=False))


@pytest.mark.skipif(not triton_interpreter_enabled(),
                    reason="CPU tensors on the kernels: needs TRITON_INTERPRET=1")
def test_autocast_on_the_triton_kernels():
    case = Case(dict(i=unit(5, 0, 16), t=unit(5, 1, 16), s=torch.tensor(10.0)), ("i", "t"),
                lambda i, t, s: clip_loss(i, t, s, backend="triton"))
    assert_same(run(case, under_autocast=True), run(case, under_autocast=False))


# ---------------------------------------------------------------------------------------------
# features of two dtypes: the autocast dtype under autocast, an error outside

MIXED = {
    "clip": (lambda a, b: clip_loss(a, b, 10.0), "text_features", "image_features"),
    "siglip": (lambda a, b: siglip_loss(a, b, 10.0, -4.0), "text_features", "image_features"),
    "info_nce": (lambda a, b: info_nce_loss(a, b, temperature=0.1), "keys", "query"),
    "module-clip": (lambda a, b: ClipLoss()(a, b, 10.0), "text_features", "image_features"),
    "module-siglip": (lambda a, b: SigLipLoss()(a, b, 10.0, -4.0), "text_features",
                      "image_features"),
    "module-info_nce": (lambda a, b: InfoNCELoss(0.1)(a, b), "keys", "query"),
    "module-nt_xent-two-views": (lambda a, b: NTXentLoss(0.5)(a, b), "second_view", "features"),
}


@pytest.mark.parametrize("name", list(MIXED))
@pytest.mark.parametrize("first, second", [(BF16, torch.float32), (torch.float32, torch.float16)],
                         ids=["bf16-fp32", "fp32-fp16"])
def test_mixed_dtypes(name, first, second):
    fn, second_name, first_name = MIXED[name]
    a, b = unit(B, 0).to(first), unit(B, 1).to(second)
    with autocast():
        mixed = fn(a, b)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, fn(a.to(BF16), b.to(BF16)), rtol=0, atol=0)
    with pytest.raises(TypeError, match=f"{second_name} has dtype {second} but {first_name} "
                       f"has {first}"):
        fn(a, b)


@pytest.mark.parametrize("name", ["clip", "info_nce", "nt_xent"])
def test_float64_stays_refused_under_autocast(name):
    """autocast leaves float64 alone, and the losses do not take it."""
    fn, arg = {"clip": (lambda x: clip_loss(x, x, 10.0), "image_features"),
               "info_nce": (lambda x: info_nce_loss(x, x), "query"),
               "nt_xent": (lambda x: nt_xent_loss(x), "features")}[name]
    with autocast(), pytest.raises(TypeError, match=f"{arg} must be float32, bfloat16 or "
                                   "float16, got torch.float64"):
        fn(unit(B, 0).double())


# ---------------------------------------------------------------------------------------------
# the ring: two gloo processes


def _ring_calls(rank, world, kind, leaves, dtype=None):
    """One ring call on this rank's leaves (``dtype``: the features cast first)."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    if kind == "clip":
        return fd.clip_loss(cast(leaves["i"]), cast(leaves["t"]), leaves["s"])
    if kind == "siglip":
        return fd.siglip_loss(cast(leaves["i"]), cast(leaves["t"]), leaves["s"], leaves["c"])
    if kind == "info_nce":
        return fd.info_nce_loss(cast(leaves["i"]), cast(leaves["t"]), temperature=leaves["s"])
    if kind == "nt_xent":
        return fd.nt_xent_loss(cast(leaves["i"]), leaves["s"])
    if kind == "module-clip":
        module = ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
        return module(cast(leaves["i"]), cast(leaves["t"]), leaves["s"])
    module = SigLipLoss(rank=rank, world_size=world)
    return module(cast(leaves["i"]), cast(leaves["t"]), leaves["s"], leaves["c"])


RING_KINDS = ["clip", "siglip", "info_nce", "nt_xent", "module-clip", "module-siglip"]


def _ring_under_autocast(rank, world):
    """Per kind: (loss, grads) under autocast (backward inside it), the same on bf16 features
    outside; and the error of features of two dtypes outside autocast."""
    rows = 2 * (2 + rank)  # uneven batches, an even count for NT-Xent's two views
    out = {}
    for kind in RING_KINDS:
        inputs = dict(i=unit(rows, 10 + rank), t=unit(rows, 20 + rank),
                      s=torch.tensor(0.25 if kind in ("info_nce", "nt_xent") else 8.0))
        if "siglip" in kind:
            inputs["c"] = torch.tensor(-3.0)
        results = []
        for under_autocast in (True, False):
            leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
            used = [v for k, v in leaves.items() if kind != "nt_xent" or k != "t"]
            with torch.autocast("cpu", dtype=BF16, enabled=under_autocast):
                loss = _ring_calls(rank, world, kind, leaves, None if under_autocast else BF16)
                grads = torch.autograd.grad(loss, used)
            results.append((loss.detach(), grads))
        out[kind] = results
    try:
        fd.clip_loss(unit(3, 0), unit(3, 1).to(BF16), 8.0)
    except TypeError as e:
        out["mixed"] = str(e)
    return out


def test_ring_under_autocast(workers):
    for rank_out in all_ok(workers(2).run(_ring_under_autocast)):
        assert "text_features has dtype torch.bfloat16 but image_features has torch.float32" \
            in rank_out.pop("mixed")
        for kind, (got, want) in rank_out.items():
            assert not isinstance(got, Raised), kind
            try:
                assert_same(got, want)
            except AssertionError as e:
                raise AssertionError(f"{kind}: {e}") from None
