"""Tests of the contrastive losses: ``clip_loss``, ``info_nce_loss``, ``nt_xent_loss``,
``siglip_loss`` and their modules, against the float64 references of ``fusedloss.reference``.

Property tests draw the batch, the width, the dtype, the logit scale (1 to 100), the bias, the
options, and random, correlated or clustered (trained-like: each pair shares a latent) features;
the loss and every gradient (features, logit_scale / temperature, logit_bias) must be within
1.5× the error of plain PyTorch in the same dtype plus the rounding floor of
``helpers.default_floor`` (``helpers.assert_close_to_ref``), with filtering on
(``filter_eps="auto"``). "Plain PyTorch" is what open_clip and SimCLR code do: the logits are
materialized in the input dtype (``logit_scale * a @ b.T``, which is what runs under autocast),
then the loss is taken in float32 (autocast runs ``F.cross_entropy`` in fp32; for SigLIP we
upcast before ``logsigmoid`` too, the stricter baseline). The few fp32 roundings that a
comparison of relative errors cannot judge (sums that cancel, a batch of one) get their own
floors, derived in ``rounding_floors``; bf16 on Triton's interpreter gets the allowance of
test_linear_cross_entropy.py (it truncates instead of rounding).

Every option has a test that fails if the option is ignored, and ClipLoss / SigLipLoss are
checked against open_clip's formulas written out here in float64 (open_clip is not installed).

Both backends run: "torch" always, "triton" on CUDA or on Triton's CPU interpreter
(``TRITON_INTERPRET=1``), where tiles are 16×16 and every kernel is slow: shapes stay tiny
there and grow on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DEVICE,
    ON_GPU,
    assert_close_to_ref,
    can_run_triton,
    default_floor,
    launches_of,
    note_case,
    rel_err,
    requires_cuda,
    requires_triton,
)
from hypothesis import given
from hypothesis import strategies as st

import fusedloss
from fusedloss import ClipLoss, InfoNCELoss, NTXentLoss, SigLipLoss
from fusedloss.core import config, engine, materialized
from fusedloss.reference import clip_loss_ref, info_nce_loss_ref, nt_xent_loss_ref, siglip_loss_ref

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
EPS32 = torch.finfo(torch.float32).eps
LOSSES = ["clip", "info_nce", "nt_xent", "siglip"]

BACKENDS = [pytest.param("torch", id="torch"),
            pytest.param("triton", id="triton", marks=requires_triton),
            pytest.param("materialized", id="materialized", marks=requires_triton)]
# The same, the Triton backend's case among the slow tests (`make test-slow`).
BACKENDS_SLOW_TRITON = [
    pytest.param("triton", id="triton", marks=[requires_triton, pytest.mark.slow])
    if p.values[0] == "triton" else p for p in BACKENDS]


# ---------------------------------------------------------------------------------------------
# problems


@dataclass(frozen=True)
class Case:
    """One call of a contrastive loss: the data to generate and every option."""

    loss: str  # "clip", "info_nce", "nt_xent" or "siglip"
    n: int  # pairs (clip, siglip), queries (info_nce), samples B (nt_xent: 2B rows)
    d: int
    dtype: torch.dtype = torch.float32
    scale: float = 10.0  # logit_scale (clip, siglip) or 1 / temperature
    bias: float | None = None  # logit_bias (clip, siglip; siglip's None passes 0.0)
    # "random", "correlated", "clustered" (trained-like), or "opposed": correlated pairs, every
    # other one negated (columns whose max lies far below other rows' maxima)
    regime: str = "random"
    reduction: str = "mean"  # clip, info_nce, nt_xent
    keys: int | None = None  # info_nce: M keys (None: M = N)
    labels: bool = False  # info_nce: explicit labels, a random injection into the keys
    learn: bool = True  # scale / temperature and bias as tensors that get gradients
    filter_eps: float | str | None = "auto"
    cluster: int = 16  # "clustered": rows per cluster
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [self.loss, f"N{self.n}", f"D{self.d}", DTYPE_NAMES[self.dtype], self.regime,
                 f"scale={self.scale:g}"]
        default = Case(loss=self.loss, n=self.n, d=self.d)
        for f in fields(self):
            if f.name in ("loss", "n", "d", "dtype", "regime", "scale"):
                continue
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                parts.append(f.name if value is True else f"{f.name}={value}")
        return "-".join(parts)

    @property
    def rows(self) -> int:
        return 2 * self.n if self.loss == "nt_xent" else self.n

    @property
    def m(self) -> int:
        """Columns of the logits."""
        return (self.keys or self.n) if self.loss == "info_nce" else self.rows


@dataclass
class Problem:
    a: torch.Tensor  # image features, queries, or the stacked views (2B, D)
    b: torch.Tensor | None  # text features or keys; None for nt_xent
    labels: torch.Tensor | None  # info_nce's explicit labels


def make_problem(case: Case, device: str = DEVICE) -> Problem:
    """L2-normalized features (fp32 on the CPU, then cast and moved).

    random:     independent directions: every softmax is flat-ish (an untrained model).
    correlated: the second member of each pair is normalize(first + 0.3·noise), a shared
                latent: with a large scale the softmax concentrates on the positive, as in a
                trained model.
    clustered:  correlated pairs whose first members gather around one center per
                ``case.cluster`` consecutive rows (hard negatives in the batch): each row's
                softmax lives in its own cluster's columns, a small tail in the others.

    D = 1 features are left unnormalized: unit vectors would be ±1, every logit would tie with
    half the others and the exact gradients would cancel to ~0, where relative errors say
    nothing (PyTorch's rounding happens to cancel exactly there, bf16 rounding of the logit
    gradient before or after the scale does not).
    """
    g = torch.Generator().manual_seed(case.seed)

    def normalize(x):
        return F.normalize(x, dim=-1) if case.d > 1 else x

    def unit(*shape):
        return normalize(torch.randn(*shape, generator=g))

    def first(rows):
        if case.regime != "clustered":
            return unit(rows, case.d)
        centers = unit(-(-rows // case.cluster), case.d)
        return normalize(centers[torch.arange(rows) // case.cluster] + 0.6 * unit(rows, case.d))

    def partner(x):
        if case.regime != "random":  # noise of norm 0.3: cos(first, partner) ≈ 0.96 at any D
            return normalize(x + 0.3 * unit(*x.shape))
        return unit(*x.shape)

    labels = None
    if case.loss == "nt_xent":
        z1 = first(case.n)
        a, b = torch.cat([z1, partner(z1)]), None
    elif case.loss == "info_nce":
        a, b = first(case.n), unit(case.m, case.d)
        positive = torch.arange(case.n)
        if case.labels:  # distinct keys, so each key is the positive of at most one query
            positive = torch.randperm(case.m, generator=g)[: case.n]
            labels = positive.to(device)
        b[positive] = partner(a)
    else:
        a = first(case.n)
        b = partner(a)
        if case.regime == "opposed":
            b[1::2] = -b[1::2]
    to = dict(device=device, dtype=case.dtype)
    return Problem(a=a.to(**to), b=None if b is None else b.to(**to), labels=labels)


# ---------------------------------------------------------------------------------------------
# the three computations: ours, PyTorch in the same dtype, float64 reference


@dataclass
class Result:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]  # "a", "b", "scale" / "temperature", "bias"


def scale_name(case: Case) -> str:
    return "scale" if case.loss in ("clip", "siglip") else "temperature"


def _leaves(case: Case, problem: Problem, dtype: torch.dtype | None = None) -> dict:
    """Fresh differentiable copies of the features, and the scalars (tensors if case.learn)."""
    out = {"a": problem.a.detach().to(dtype or problem.a.dtype).clone().requires_grad_()}
    if problem.b is not None:
        out["b"] = problem.b.detach().to(dtype or problem.b.dtype).clone().requires_grad_()
    scalar_dtype = dtype or torch.float32
    value = case.scale if scale_name(case) == "scale" else 1.0 / case.scale
    bias = case.bias if case.bias is not None else (0.0 if case.loss == "siglip" else None)
    if case.learn:
        out[scale_name(case)] = torch.tensor(value, dtype=scalar_dtype, device=DEVICE,
                                             requires_grad=True)
        if bias is not None:
            out["bias"] = torch.tensor(bias, dtype=scalar_dtype, device=DEVICE,
                                       requires_grad=True)
    else:
        out[scale_name(case)] = value
        if bias is not None:
            out["bias"] = bias
    return out


def _upstream(like: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(like.shape, generator=g).to(device=like.device, dtype=like.dtype)


def _result(loss: torch.Tensor, leaves: dict, case: Case) -> Result:
    """Backpropagates a fixed random upstream gradient (the full VJP for per-row losses)."""
    total = loss.sum() if loss.dim() == 0 else (loss * _upstream(loss, case.seed)).sum()
    total.backward()
    grads = {k: t.grad for k, t in leaves.items() if isinstance(t, torch.Tensor)}
    return Result(loss.detach(), grads)


def call_ours(case: Case, problem: Problem, leaves: dict, backend: str, **extra):
    if case.loss == "clip":
        return fusedloss.clip_loss(leaves["a"], leaves["b"], leaves["scale"], leaves.get("bias"),
                                   reduction=case.reduction, filter_eps=case.filter_eps,
                                   backend=backend, **extra)
    if case.loss == "info_nce":
        return fusedloss.info_nce_loss(leaves["a"], leaves["b"], problem.labels,
                                       temperature=leaves["temperature"],
                                       reduction=case.reduction, filter_eps=case.filter_eps,
                                       backend=backend, **extra)
    if case.loss == "nt_xent":
        return fusedloss.nt_xent_loss(leaves["a"], leaves["temperature"],
                                      reduction=case.reduction, filter_eps=case.filter_eps,
                                      backend=backend, **extra)
    return fusedloss.siglip_loss(leaves["a"], leaves["b"], leaves["scale"], leaves["bias"],
                                 backend=backend, **extra)


def run_ours(case: Case, problem: Problem, backend: str, **extra) -> Result:
    leaves = _leaves(case, problem)
    return _result(call_ours(case, problem, leaves, backend, **extra), leaves, case)


def run_reference(case: Case, problem: Problem) -> Result:
    leaves = _leaves(case, problem, torch.float64)
    a, b = leaves["a"], leaves.get("b")
    if case.loss == "clip":
        loss = clip_loss_ref(a, b, leaves["scale"], leaves.get("bias"), reduction=case.reduction)
    elif case.loss == "info_nce":
        loss = info_nce_loss_ref(a, b, problem.labels, temperature=leaves["temperature"],
                                 reduction=case.reduction)
    elif case.loss == "nt_xent":
        loss = nt_xent_loss_ref(a, leaves["temperature"], reduction=case.reduction)
    else:
        loss = siglip_loss_ref(a, b, leaves["scale"], leaves["bias"])
    return _result(loss, leaves, case)


def _reduce(per_row: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return per_row
    return per_row.sum() if reduction == "sum" else per_row.mean()


def torch_same_dtype(case: Case, problem: Problem, leaves: dict) -> torch.Tensor:
    """Plain PyTorch as open_clip / SimCLR write it: logits in the input dtype (what autocast
    runs), the loss in float32 (autocast's F.cross_entropy; logsigmoid upcast likewise)."""
    a, b = leaves["a"], leaves.get("b")
    if case.loss == "clip":
        logits = leaves["scale"] * a @ b.T
        if "bias" in leaves:
            logits = logits + leaves["bias"]
        logits = logits.float()
        labels = torch.arange(case.n, device=a.device)
        per_row = (F.cross_entropy(logits, labels, reduction="none")
                   + F.cross_entropy(logits.T, labels, reduction="none")) / 2
        return _reduce(per_row, case.reduction)
    if case.loss == "info_nce":
        logits = (a @ b.T / leaves["temperature"]).float()
        labels = problem.labels if problem.labels is not None else torch.arange(
            case.n, device=a.device)
        return F.cross_entropy(logits, labels, reduction=case.reduction)
    if case.loss == "nt_xent":
        logits = a @ a.T / leaves["temperature"]
        self_pairs = torch.eye(case.rows, dtype=torch.bool, device=a.device)
        logits = logits.masked_fill(self_pairs, float("-inf")).float()
        rows = torch.arange(case.rows, device=a.device)
        return F.cross_entropy(logits, (rows + case.n) % case.rows, reduction=case.reduction)
    logits = (leaves["scale"] * a @ b.T + leaves["bias"]).float()
    labels = 2 * torch.eye(case.n, device=a.device) - 1
    return -F.logsigmoid(labels * logits).sum() / case.n


def run_torch_same_dtype(case: Case, problem: Problem) -> Result:
    leaves = _leaves(case, problem)
    return _result(torch_same_dtype(case, problem, leaves), leaves, case)


# ---------------------------------------------------------------------------------------------
# checks


def check_invariants(case: Case, problem: Problem, ours: Result,
                     ref: Result | None = None) -> None:
    """What holds whatever the rounding: finite, fp32 loss, gradients in the input dtype,
    per-row losses ≥ 0 (each is an lse minus one of its terms) up to the lse's rounding.
    ``ref``: the float64 reference; feature gradients whose exact value lies at or beyond the
    dtype's largest number (fp16's 65504: a summed loss over thousands of rows at a small
    temperature) must be that large, or ±inf, with the reference's sign."""
    assert ours.loss.dtype == torch.float32
    assert torch.isfinite(ours.loss).all(), "loss is not finite"
    for name, grad in ours.grads.items():
        expected = case.dtype if name in ("a", "b") else torch.float32
        huge = torch.zeros_like(grad, dtype=torch.bool)
        if ref is not None and name in ("a", "b"):
            exact = ref.grads[name].to(grad.device)
            huge = _beyond_range(exact, grad.dtype)
            big = grad[huge].double()
            assert (big * exact[huge].sign() >= 0.9 * torch.finfo(grad.dtype).max).all(), (
                f"grad {name} beyond the dtype's range: {big} for {exact[huge]}")
        assert torch.isfinite(grad[~huge]).all(), f"grad {name} is not finite"
        assert grad.dtype == expected, f"grad {name} is {grad.dtype}, not {expected}"
    if case.reduction == "none" and case.loss != "siglip":
        assert ours.loss.shape == (case.rows,)
        largest = _logits64(case, problem)[1].nan_to_num(0, 0, 0).abs().max().item()
        rounding = 8 * EPS32 * (largest + math.log(case.m + 1))
        assert (ours.loss >= -rounding).all(), f"negative per-row loss {ours.loss.min()}"
    else:
        assert ours.loss.shape == ()
    if case.loss == "clip" and "bias" in ours.grads:
        # a scalar bias shifts every logit: no softmax sees it
        assert (ours.grads["bias"] == 0).all(), "clip's logit_bias must get an exact 0 grad"


def _beyond_range(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Entries of a float64 result at or beyond 0.99 × the dtype's largest finite number,
    where rounding (to ±inf past it) is not a matter of accuracy."""
    return exact.abs() >= 0.99 * torch.finfo(dtype).max


def _logits64(case: Case, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """(A Bᵀ, X) in float64 on the CPU: X as the loss sees it (bias in, SimCLR's diagonal out)."""
    a = problem.a.double().cpu()
    b = a if problem.b is None else problem.b.double().cpu()
    dots = a @ b.T
    x = case.scale * dots + ((case.bias or 0.0) if case.loss in ("clip", "siglip") else 0.0)
    if case.loss == "nt_xent":
        x = x.masked_fill(torch.eye(case.rows, dtype=torch.bool), float("-inf"))
    return dots, x


def _upstream_rows(case: Case) -> torch.Tensor:
    """The per-row upstream gradient g that _result applies (float64, CPU); SigLIP's loss is
    a scalar whatever ``case.reduction``: 1 (its 1/b is in its dX)."""
    rows = torch.empty(case.rows, dtype=torch.float64)
    if case.loss == "siglip":
        return torch.ones_like(rows)
    if case.reduction == "none":
        return _upstream(rows, case.seed)
    return torch.ones_like(rows) / (case.rows if case.reduction == "mean" else 1)


def _logit_grad_terms(case: Case, problem: Problem, x: torch.Tensor) -> dict:
    """The float64 terms of dX (docs/design.md, top): dX = r·P + c·Q − t·onehot, or SigLIP's
    −g·z·σ(−zX), each (N, M); their sum is the exact logit gradient."""
    g = _upstream_rows(case)
    if case.loss == "siglip":
        z = 2 * torch.eye(case.n, dtype=torch.float64) - 1
        return {"sigmoid": -(g / case.n)[:, None] * z * torch.sigmoid(-z * x)}
    rows = torch.arange(case.rows)
    if case.loss == "info_nce" and problem.labels is not None:
        target = problem.labels.cpu()
    elif case.loss == "nt_xent":
        target = (rows + case.n) % case.rows
    else:
        target = rows
    onehot = torch.zeros_like(x)
    onehot[rows, target] = 1.0
    p = torch.softmax(x, dim=1)
    if case.loss != "clip":
        return {"row": g[:, None] * p, "target": -g[:, None] * onehot}
    q = torch.softmax(x, dim=0)
    return {"row": 0.5 * g[:, None] * p, "col": 0.5 * g[None, :] * q,
            "target": -g[:, None] * onehot}


def rounding_floors(case: Case, problem: Problem, ref: Result, backend: str,
                    known_bugs: bool = True, tensor_cores: bool | None = None) -> tuple:
    """Relative error floors (loss, {gradient: floor}) for fp32 roundings that a relative
    comparison with PyTorch's error does not see. They matter for fp32 inputs (PyTorch's error
    ~1e-7); bf16 / fp16 rounding dwarfs them.

    1. dX is assembled from rounded terms, r·P + c·Q − t: for a confident row (P_ii → 1) they
       cancel, and each term's roundings (~eps32·|term|) are large against their sum
       (F.cross_entropy's P − 1 cancels exactly first; a saturated row's softmax rounds
       1 + δ either way). Propagated through the gradient matmuls as independent errors,
       ‖ΔdA_i‖² ≈ s²·Σ_j ΔdX_ij²·‖B_j‖² (likewise dB), and summed whole into the scalars,
       |Δds| ≤ Σ |ΔdX|·|A Bᵀ|.
       Likewise a confident row's loss log Σ exp(X − X_ii) = log(1 + δ) is off by ~eps32 in
       absolute terms (the sum is rounded near 1), in PyTorch's log_softmax as in ours: a
       relative error eps32/δ either way, whose ratio is chance.
    2. Scalar gradients are sums over all N·M logits: ds = Σ dX ⊙ A Bᵀ, dbias = Σ dX. Where the
       terms cancel (condition number κ = Σ|terms| / |Σ terms|) an fp32 accumulation is off by
       ~κ·eps32 in any order, and PyTorch's own error may be small by chance.
    3. A row's (column's) factors such as σ(X) or exp(X − lse) carry a few fp32 ulps, and the
       logit's rounding (item 5), that the whole row of the feature gradient shares: they
       average over rows, not over D as default_floor assumes (a batch of one is a single
       such row): (4·eps32 + max ΔX) / rows.
    4. (none: the torch backend's column LSE used to be rounded to fp32; fixed, and
       test_torch_backend_clip_column_lse_within_strict_bar guards it.)
    5. Every fp32 logit is itself a rounded sum of D products, ΔX ≈ 2·eps32·(s·Σ_k|a_k b_k|
       + |bias|) in any summation order (the rounding of <a, b> alone when its products do not
       cancel; far more than eps32·|<a, b>| when they do: random unit rows in D = 768 give
       |<a, b>| ≈ 0.004 from Σ|a_k b_k| ≈ 0.64, and orders of summation that differ in their
       blocking alone moved that dot product by 4e-8 to 1.9e-6 of itself), in PyTorch's
       computation as in ours but not alike: the loss moves by ~‖∂L/∂X ⊙ ΔX‖, a sum Σ t_ij
       over the logits (ds, dbias) by ~‖t ⊙ ΔX‖, and ds, which multiplies the raw logits, also
       by ~‖dX ⊙ ΔX‖ / s; a relative comparison judges these only where many logits average
       them (a batch of one is a lottery).
    6. (in check_against_reference) The feature gradients are fp32 sums of K = M (dA) or N (dB)
       products, whose rounding depends on the matmul's summation order: eps32·log2 K relative
       to Σ|terms| (a blocked or pairwise sum's growth), times the cancellation ‖|dX|·|B|‖ /
       ‖dX·B‖. PyTorch's cuBLAS call may pick a luckier order for the same shape (measured,
       CLIP N = 1031, D = 1, fp32: its dB error 6.1e-8 on a GPU, 1.2e-7 on a CPU, where the
       same fp32 product of exact inputs in another layout gave 5.4e-7).
    7. ``tensor_cores`` (default: the Triton backend on a GPU with fp16 / bf16 inputs): the
       tensor cores add each k-step of 16 products into the fp32 logit by truncation, not
       rounding: up to about an ulp of the partial sum per step (and one more for the step's
       own alignment), errors of one sign wherever the partial sums keep theirs, so that they
       add up over the logits instead of averaging: ΔX ≤ 2·eps32·s·Σ_k |Σ_{i<16k} a_i b_i|
       (measured on an H200, fp16, D = 768, unit rows: the largest logit error 3.7e-6,
       31 eps32; the largest bound 6.3e-6, a row's product with itself, whose partial sums
       climb to 1; test_tensor_core_floor_bounds_truncated_sums checks an emulation). The
       loss moves by up to Σ |∂L/∂X|·ΔX, the scalar sums likewise (Σ |t|·ΔX, and ds also by
       Σ |dX|·ΔX / s through the raw logits it multiplies), the feature gradients by |dX|·ΔX
       per entry (item 1's way).
       PyTorch's logits, rounded to the input dtype to nearest, average instead: where many
       logits enter one number (NT-Xent's dτ over 90,000 logits: 1.7e-6 ours, 3.9e-8
       PyTorch's; SigLIP's loss at s = 50 on clustered features: 1.9e-6 and 4.8e-7) a
       relative comparison would charge the hardware's rounding to the kernel.
    """
    if tensor_cores is None:
        tensor_cores = (backend in ("triton", "materialized") and ON_GPU
                        and case.dtype != torch.float32)

    def relative(err, scale) -> float:
        scale = float(scale)
        return float(err) / scale if scale > 0 else 0.0

    with torch.no_grad():
        a = problem.a.double().cpu()
        b = a if problem.b is None else problem.b.double().cpu()
        dots, x = _logits64(case, problem)
        terms = _logit_grad_terms(case, problem, x)
        d_x = sum(terms.values())
        err_x = EPS32 * sum(t.abs() for t in terms.values())  # item 1
        loss_err = torch.full((case.rows,), 0.0 if case.loss == "siglip" else 2 * EPS32,
                              dtype=torch.float64)
        ref_loss = ref.loss.double().cpu()
        # A logit's rounding error scales with its parts, the products s·a_k·b_k and the bias,
        # which may cancel: |X| would understate it (SigLIP's 14·0.96 − 10; item 5).
        bias = abs(case.bias or 0.0) if case.loss in ("clip", "siglip") else 0.0
        x_err = 2 * EPS32 * torch.where(torch.isfinite(x), case.scale * (a.abs() @ b.abs().T)
                                        + bias, 0.0)
        # Item 7: the tensor cores' truncated sums, errors of one sign (absolute, per logit).
        coherent = torch.zeros_like(x)
        if tensor_cores:
            coherent = torch.where(torch.isfinite(x),
                                   2 * EPS32 * case.scale * _partial_sums(a, b), 0.0)
        coherent_dx = d_x.abs() * coherent  # item 7's share of each entry of dX
        if case.reduction == "none" and case.loss != "siglip":
            unit = replace(case, reduction="sum")  # each row's own sensitivity: upstream 1
            d_x_unit = sum(_logit_grad_terms(unit, problem, x).values())
            loss_err = loss_err + (d_x_unit * x_err).norm(dim=1)  # item 5
            loss_err = loss_err + (d_x_unit.abs() * coherent).sum(dim=1)  # item 7
            loss_floor = relative(loss_err.norm(), ref_loss.norm())
        else:
            total = (loss_err * _upstream_rows(case).abs()).sum()
            total = total + (d_x * x_err).norm()  # item 5
            total = total + coherent_dx.sum()  # item 7
            loss_floor = relative(total, ref_loss.abs())
        var_x = err_x.square() + coherent_dx.square()
        # The scalars: summed whole (the rows' errors need not average: a saturated row's
        # 1 + δ rounds alike in PyTorch's fp32 softmax and ours, measured 11-21% on ds).
        absolute = {"scale": (err_x * dots.nan_to_num(0).abs()).sum(), "bias": err_x.sum()}
        norm_a2, norm_b2 = a.square().sum(1), b.square().sum(1)
        if case.loss == "nt_xent":  # dZ = s·(dX + dXᵀ)·Z
            absolute["a"] = case.scale * ((var_x + var_x.T) @ norm_a2).sum().sqrt()
        else:
            absolute["a"] = case.scale * (var_x @ norm_b2).sum().sqrt()
            absolute["b"] = case.scale * (var_x.T @ norm_a2).sum().sqrt()
        scalar_terms = {"scale": d_x * dots.nan_to_num(0), "bias": d_x}  # item 2
        through_raw = {"scale": (coherent_dx.sum() + (d_x * x_err).norm()) / case.scale,
                       "bias": 0.0}
        conditioning = {  # items 2, 5 and 7
            name: relative(EPS32 * t.abs().sum() + (t * x_err).norm()
                           + (t.abs() * coherent).sum() + through_raw[name], t.sum().abs())
            for name, t in scalar_terms.items()}
    shared = (4 * EPS32 + x_err.max().item()) / min(case.rows, case.m)  # item 3
    floors = {}
    for name, grad in ref.grads.items():
        key = "scale" if name == "temperature" else name  # dτ = −s²·ds: relative errors agree
        ref_abs = grad.double().norm() / (case.scale**2 if name == "temperature" else 1.0)
        floors[name] = (relative(absolute[key], ref_abs) + conditioning.get(key, 0.0)
                        + (shared if name in ("a", "b") else 0.0))
    return loss_floor, floors


def _partial_sums(a: torch.Tensor, b: torch.Tensor, step: int = 16) -> torch.Tensor:
    """Σ_k |Σ_{i<step·k} a_i b_i| for every pair of rows (float64, (N, M)): the partial sums
    that a tensor-core matmul rounds, k-step by k-step."""
    partial = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    total = torch.zeros_like(partial)
    for k in range(0, a.shape[1], step):
        partial += a[:, k:k + step] @ b[:, k:k + step].T
        total += partial.abs()
    return total


def underflow_floor(case: Case, ref: torch.Tensor) -> float:
    """Logit gradients below fp32's smallest normal number (the kernels compute in fp32) may
    be flushed to 0 by some matmuls (SigLIP's σ(−90) = 8e-40): at most tiny per entry of dX,
    times s and the row or column count in each gradient entry. Negligible unless the whole
    gradient underflows."""
    scale = ref.double().norm().item()
    tiny = torch.finfo(torch.float32).tiny * max(1.0, case.scale) * case.rows * case.m
    return tiny * max(ref.numel(), 1) ** 0.5 / scale if scale > 0 else 0.0


INTERPRETER_BF16_FACTOR = 2.5
BF16_HALF_ULP = 0.5 * torch.finfo(torch.bfloat16).eps


def check_against_reference(case: Case, problem: Problem, ours: Result, theirs: Result,
                            ref: Result, backend: str, *, strict: bool = False) -> None:
    """The loss and every gradient within 1.5× PyTorch's error + default_floor + the floors
    of rounding_floors (item 4, a known bug of the torch backend, only unless ``strict``).

    bf16 on Triton's interpreter: it converts fp32 to bf16 by truncation, not round-to-nearest
    (docs/companions.md, "Triton's interpreter"), so every bf16 value the kernels store (the
    dX scratch) carries twice the error, biased toward zero: factor 2.5 and half a bf16 ulp, as in
    test_linear_cross_entropy.py, times how much the gradient cancels (biased errors do not).
    GPUs round to nearest: there the bar is the library's,
    except for SigLIP's (fp32) bias gradient on the Triton backend: a sum of the dX scratch,
    rounded to the input dtype entry by entry, as PyTorch sums its logit gradient in that
    dtype. Neighbouring entries round alike (measured: 6x the error of independent roundings,
    fp16), so the errors need not average: half an ulp of the dtype times Σ|dX| / |Σ dX|.
    PyTorch's error on this one number is a lottery (7e-6 where rounding dX to nearest and
    summing gives 4e-5).
    """
    interpreted_bf16 = (backend in ("triton", "materialized") and not ON_GPU
                        and case.dtype == torch.bfloat16)
    factor = INTERPRETER_BF16_FACTOR if interpreted_bf16 else 1.5
    loss_floor, grad_floors = rounding_floors(case, problem, ref, backend,
                                              known_bugs=not strict)
    assert_close_to_ref(ours.loss, _baseline(theirs.loss, ref.loss), ref.loss, factor=factor,
                        floor=default_floor(ours.loss) + loss_floor, name="loss")
    for name, ref_grad in ref.grads.items():
        if case.loss == "clip" and name == "bias":
            assert ref_grad.abs().item() < 1e-9  # 0 up to float64 rounding (checked exact above)
            continue
        grad = ours.grads[name]
        floor = default_floor(grad) + grad_floors[name] + underflow_floor(case, ref_grad)
        baseline = _baseline(theirs.grads[name], ref_grad)
        if name in ("a", "b"):
            # Entries beyond the dtype's range are check_invariants' (±inf allowed).
            inside = ~_beyond_range(ref_grad, grad.dtype).to(grad.device)
            grad, ref_grad = grad[inside], ref_grad.to(grad.device)[inside]
            baseline = baseline.to(grad.device)[inside]
            # Item 6 of rounding_floors.
            terms = case.m if name == "a" else case.rows  # the sum's length
            condition = _feature_condition(case, problem, name)
            floor += EPS32 * max(1.0, math.log2(terms)) * condition
            if interpreted_bf16:
                floor += BF16_HALF_ULP * condition
        elif backend == "triton" and name == "bias":
            floor += 0.5 * torch.finfo(case.dtype).eps * _bias_condition(case, problem)
        assert_close_to_ref(grad, baseline, ref_grad, factor=factor, floor=floor,
                            name=f"grad {name}")


def _baseline(torch_result: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """PyTorch's result, or where it overflowed (fp16 logits, or their gradient through the
    temperature, beyond 65504) the reference rounded to that dtype: the best it could be."""
    if bool(torch.isfinite(torch_result).all()):
        return torch_result
    return ref.to(torch_result.dtype)


def _feature_condition(case: Case, problem: Problem, name: str) -> float:
    """‖|dX|·|B|‖ / ‖dX·B‖ (or Aᵀ for "b"; SimCLR: dX + dXᵀ): ≥ 1, large where the feature
    gradient is a small difference of large terms."""
    a = problem.a.double().cpu()
    b = a if problem.b is None else problem.b.double().cpu()
    d_x = sum(_logit_grad_terms(case, problem, _logits64(case, problem)[1]).values())
    if case.loss == "nt_xent":
        d_x = d_x + d_x.T
    if name == "b":
        d_x, b = d_x.T, a
    exact = (d_x @ b).norm().item()
    return (d_x.abs() @ b.abs()).norm().item() / exact if exact > 0 else 1.0


def _bias_condition(case: Case, problem: Problem) -> float:
    """Σ|dX| / |Σ dX|: how much the rounding of each dX entry weighs in the bias gradient, a
    sum of the dX scratch, which holds dX in the input dtype."""
    d_x = sum(_logit_grad_terms(case, problem, _logits64(case, problem)[1]).values())
    total = d_x.sum().abs().item()
    return d_x.abs().sum().item() / total if total > 0 else 0.0


def check_case(case: Case, backend: str, **extra) -> Result:
    note_case(case.id)
    problem = make_problem(case)
    ours = run_ours(case, problem, backend, **extra)
    ref = run_reference(case, problem)
    check_invariants(case, problem, ours, ref)
    check_against_reference(case, problem, ours, run_torch_same_dtype(case, problem), ref,
                            backend)
    return ours


# ---------------------------------------------------------------------------------------------
# strategies


@st.composite
def cases(draw, loss: str, batches, widths) -> Case:
    dtype = draw(st.sampled_from(list(DTYPES.values())))
    n = draw(st.sampled_from(batches))
    keys = None
    if loss == "info_nce":
        keys = draw(st.sampled_from([None, n, 2 * n + 5]))  # M = N, or a queue of negatives
    bias = None
    if loss in ("clip", "siglip"):
        bias = draw(st.sampled_from([None, -10.0, 2.5]))  # open_clip's SigLIP init is -10
    explicit = [1e-9] if dtype == torch.float32 else [1e-9, 2.0**-15]
    eps = draw(st.sampled_from(["auto", "auto", None, 0.0, *explicit]))
    return Case(
        loss=loss,
        n=n,
        d=draw(st.sampled_from(widths)),
        dtype=dtype,
        scale=draw(st.sampled_from([1 / 0.07, 1.0, 3.0, 1 / 0.07, 50.0, 100.0])),
        bias=bias,
        regime=draw(st.sampled_from(["random", "correlated", "clustered"])),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        keys=keys,
        labels=loss == "info_nce" and draw(st.booleans()),
        learn=draw(st.sampled_from([True, True, False])),
        filter_eps=eps,
        seed=draw(st.integers(0, 2**16)),
    )


# First values: what Hypothesis tries first and shrinks toward (a moderate shape); the
# degenerate ones (batch 1, D = 1) stay, but rarer. Batches over 1000 cost seconds each on a
# CPU: there they are the fixed LARGE cases below, on a GPU they are drawn too.
if ON_GPU:
    TORCH_SHAPES = dict(batches=[128, 1, 2, 3, 37, 1031, 2053], widths=[64, 1, 7, 64, 768])
    # 64 and 512: the Hopper kernels' widths (D a multiple of 64 up to 512)
    TRITON_SHAPES = dict(batches=[300, 1, 2, 3, 37, 1031, 2053],
                         widths=[64, 1, 7, 64, 512, 768])
else:  # the interpreter: several 16×16 tiles and ragged edges, nothing more
    TORCH_SHAPES = dict(batches=[37, 1, 2, 3, 37, 128, 257], widths=[64, 1, 7, 64, 768])
    TRITON_SHAPES = dict(batches=[37, 1, 2, 3, 37, 70], widths=[16, 1, 7, 64])


# ---------------------------------------------------------------------------------------------
# property tests


@pytest.mark.parametrize("loss", LOSSES)
@given(data=st.data())
def test_torch_backend_matches_reference(loss, data):
    check_case(data.draw(cases(loss, **TORCH_SHAPES), label="case"), "torch")


@pytest.mark.slow
@requires_triton
@pytest.mark.parametrize("loss", LOSSES)
@given(data=st.data())  # the profile's budget: the interpreter keeps its shapes tiny instead
def test_triton_backend_matches_reference(loss, data):
    """On an sm90 GPU, half the examples run the Gluon recompute whatever the backward's size
    (the engine takes it from 2^15 tiles, beyond these shapes), where it applies."""
    case = data.draw(cases(loss, **TRITON_SHAPES), label="case")
    tiles = config.tuning().gluon_recompute_tiles
    if ON_GPU:
        tiles = data.draw(st.sampled_from([tiles, 0]), label="gluon_recompute_tiles")
    with config.tuned(gluon_recompute_tiles=tiles):
        check_case(case, "triton")


# The materialized path's blocks are 64 wide (rows, columns and D steps) on either machine.
MATERIALIZED_SHAPES = TORCH_SHAPES if ON_GPU else dict(batches=[37, 1, 2, 3, 37, 130],
                                                       widths=[16, 1, 7, 64, 200])


@requires_triton
@pytest.mark.parametrize("loss", [pytest.param(loss, marks=pytest.mark.slow) if loss == "nt_xent"
                                  else loss for loss in LOSSES])
@given(data=st.data())  # two short passes: a draw takes a second or less on the interpreter
def test_materialized_backend_matches_reference(loss, data):
    check_case(data.draw(cases(loss, **MATERIALIZED_SHAPES), label="case"), "materialized")


# ---------------------------------------------------------------------------------------------
# fixed cases: batches over 1000 (the CPU draws stop at 257), and peaked inputs with filtering


LARGE = [
    Case(loss="clip", n=1031, d=768, dtype=torch.bfloat16, scale=100.0, regime="correlated"),
    Case(loss="info_nce", n=1031, d=64, dtype=torch.float16, scale=1 / 0.07,
         regime="correlated", keys=2067, labels=True, reduction="none"),
    Case(loss="nt_xent", n=520, d=128, dtype=torch.float32, scale=2.0, regime="correlated",
         reduction="sum"),
    Case(loss="siglip", n=1031, d=64, dtype=torch.bfloat16, scale=10.0, bias=-10.0,
         regime="correlated"),
]
LARGE_BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(
        not ON_GPU, reason="too slow on Triton's interpreter: test_triton_backend_matches_"
        "reference covers the kernels there")),
    pytest.param("materialized", id="materialized", marks=pytest.mark.skipif(
        not ON_GPU, reason="slow on Triton's interpreter: test_materialized_backend_matches_"
        "reference covers the kernels there")),
]


@pytest.mark.parametrize("backend", LARGE_BACKENDS)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in LARGE])
def test_large_batches(case, backend):
    check_case(case, backend)


# Peaked: correlated pairs at logit scale 100, the softmax concentrated on the positive; and
# clustered ones at scale 30, where the automatic filter_eps of bf16 / fp16 does skip tiles
# (each row's mass outside its cluster is below it). Either way the result meets the bar.
_PEAKED_N = 512 if ON_GPU else 48
# The interpreter's tiles are 16×16; a GPU's forward tiles (the filter's statistics) 128×256.
_CLUSTER = 256 if ON_GPU else 16
PEAKED = [
    Case(loss="clip", n=_PEAKED_N, d=16, dtype=torch.bfloat16, scale=100.0, regime="correlated",
         bias=2.5),
    Case(loss="clip", n=_PEAKED_N, d=16, dtype=torch.float16, scale=30.0, regime="clustered",
         cluster=_CLUSTER, reduction="none"),
    Case(loss="clip", n=_PEAKED_N, d=16, dtype=torch.float32, scale=100.0, regime="correlated"),
    # Tiles whose column maxima lie far below their largest row max: the kernels' column sums
    # (forward) and column softmax (backward) take their per-column form there.
    Case(loss="clip", n=_PEAKED_N, d=16, dtype=torch.bfloat16, scale=200.0, regime="opposed"),
    Case(loss="info_nce", n=_PEAKED_N, d=16, dtype=torch.bfloat16, scale=100.0,
         regime="correlated", keys=2 * _PEAKED_N + 5, labels=True),
    Case(loss="info_nce", n=_PEAKED_N, d=16, dtype=torch.bfloat16, scale=30.0,
         regime="clustered", cluster=_CLUSTER, keys=_PEAKED_N + 5),
    Case(loss="nt_xent", n=_PEAKED_N // 2, d=16, dtype=torch.bfloat16, scale=100.0,
         regime="correlated", reduction="none"),
    Case(loss="nt_xent", n=2 * _CLUSTER, d=16, dtype=torch.float16, scale=30.0,
         regime="clustered", cluster=_CLUSTER),
    Case(loss="siglip", n=_PEAKED_N, d=16, dtype=torch.bfloat16, scale=100.0, bias=-10.0,
         regime="correlated"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in PEAKED])
def test_peaked_with_filtering(case, backend):
    check_case(case, backend)


def _truncating_dot(a: torch.Tensor, b: torch.Tensor, step: int = 16) -> torch.Tensor:
    """A Bᵀ of fp16 rows as the tensor cores accumulate it: each k-step's 16 products (exact in
    fp16 → fp32) added to the fp32 accumulator, the sum rounded toward zero."""
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32)
    a64, b64 = a.double(), b.double()
    for k in range(0, a.shape[1], step):
        exact = acc.double() + a64[:, k:k + step] @ b64[:, k:k + step].T
        nearest = exact.float()
        away = nearest.double().abs() > exact.abs()  # rounded away from zero: one ulp back
        acc = torch.where(away, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    return acc


@pytest.mark.parametrize("regime", ["random", "clustered"])
def test_tensor_core_floor_bounds_truncated_sums(regime):
    """rounding_floors' item 7 against an emulation of the tensor cores' accumulation: every
    logit's error within 2·eps32·Σ_k |partial sum_k|, where a model of one fp32 rounding of
    the result (2·eps32·|A Bᵀ|) falls short on clustered features (partial sums that climb
    together truncate alike)."""
    case = Case(loss="clip", n=64, d=768, dtype=torch.float16, scale=1.0, regime=regime,
                cluster=8)
    problem = make_problem(case)
    a, b = problem.a.cpu(), problem.b.cpu()
    exact = a.double() @ b.double().T
    error = (_truncating_dot(a, b).double() - exact).abs()
    bound = 2 * EPS32 * _partial_sums(a.double(), b.double())
    assert (error <= bound).all(), float((error / bound).max())
    if regime == "clustered":
        assert (error > 2 * EPS32 * exact.abs()).any()


def test_torch_backend_clip_column_lse_within_strict_bar():
    """rounding_floors' item 4 checked without its allowance: measured 2.6x over the bar
    (grad of the image features 1.1e-2 vs PyTorch's 4.7e-4); with the column partials merged
    as exp(log_sum) · exp(top − safe) it passes, as the Triton backend does."""
    case = Case(loss="clip", n=64, d=32, dtype=torch.float32, scale=100.0, regime="clustered")
    problem = make_problem(case)
    check_against_reference(case, problem, run_ours(case, problem, "torch"),
                            run_torch_same_dtype(case, problem), run_reference(case, problem),
                            "torch", strict=True)


# ---------------------------------------------------------------------------------------------
# open_clip's formulas (open_clip.loss.ClipLoss / SigLipLoss on one process), in float64


def open_clip_clip_loss(image_features, text_features, logit_scale, logit_bias=None):
    logits_per_image = logit_scale * image_features @ text_features.T
    logits_per_text = logit_scale * text_features @ image_features.T
    if logit_bias is not None:
        logits_per_image = logits_per_image + logit_bias
        logits_per_text = logits_per_text + logit_bias
    labels = torch.arange(logits_per_image.shape[0], device=image_features.device)
    return (F.cross_entropy(logits_per_image, labels)
            + F.cross_entropy(logits_per_text, labels)) / 2


def open_clip_siglip_loss(image_features, text_features, logit_scale, logit_bias):
    b = image_features.shape[0]
    logits = logit_scale * image_features @ text_features.T + logit_bias
    eye = torch.eye(b, device=image_features.device, dtype=logits.dtype)
    labels = 2 * eye - torch.ones_like(eye)
    return -F.logsigmoid(labels * logits).sum() / b


def _open_clip_inputs(bias: float | None, dtype=torch.float32):
    case = Case(loss="clip", n=37, d=32, regime="random", seed=3)  # O(1) gradients
    problem = make_problem(case)
    leaves = [problem.a.to(dtype), problem.b.to(dtype),
              torch.tensor(1 / 0.07, device=DEVICE, dtype=dtype)]
    if bias is not None:
        leaves.append(torch.tensor(bias, device=DEVICE, dtype=dtype))
    return [t.detach().clone().requires_grad_() for t in leaves]


def _loss_and_grads(fn, leaves):
    loss = fn(*leaves)
    loss = loss["contrastive_loss"] if isinstance(loss, dict) else loss
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, bias", [("clip", None), ("clip", 2.5), ("siglip", -10.0)],
                         ids=["clip", "clip-bias", "siglip"])
def test_modules_match_open_clip(kind, bias, backend):
    """ClipLoss / SigLipLoss (fp32) against open_clip's formulas in float64, loss and every
    gradient (logit_scale and logit_bias included); the references agree to float64 rounding."""
    module = (ClipLoss if kind == "clip" else SigLipLoss)(backend=backend)
    formula = open_clip_clip_loss if kind == "clip" else open_clip_siglip_loss
    reference = clip_loss_ref if kind == "clip" else siglip_loss_ref
    ours_loss, ours_grads = _loss_and_grads(module, _open_clip_inputs(bias))
    exact_loss, exact_grads = _loss_and_grads(formula, _open_clip_inputs(bias, torch.float64))
    ref_loss, ref_grads = _loss_and_grads(reference, _open_clip_inputs(bias, torch.float64))
    assert rel_err(ref_loss, exact_loss) < 1e-10
    assert rel_err(ours_loss, exact_loss) < 1e-4  # fp32 rounding; a formula error is O(1)
    names = ["image_features", "text_features", "logit_scale", "logit_bias"]
    for name, ours, exact, ref in zip(names, ours_grads, exact_grads, ref_grads, strict=False):
        if kind == "clip" and name == "logit_bias":  # 0 in exact arithmetic
            assert ours.item() == 0.0 and abs(exact.item()) < 1e-12 and abs(ref.item()) < 1e-12
            continue
        assert rel_err(ref, exact) < 1e-10, name
        assert rel_err(ours, exact) < 1e-4, name


# ---------------------------------------------------------------------------------------------
# options: each one changes the result where it should, and matches the reference


def _changed(x: torch.Tensor, y: torch.Tensor, at_least: float = 1e-3) -> bool:
    return x.shape != y.shape or rel_err(x, y) > at_least


BASE = {
    "clip": Case(loss="clip", n=37, d=16, dtype=torch.bfloat16, scale=1 / 0.07,
                 regime="correlated", bias=2.5),
    "info_nce": Case(loss="info_nce", n=37, d=16, dtype=torch.bfloat16, scale=1 / 0.07,
                     regime="correlated", keys=53, labels=True),
    "nt_xent": Case(loss="nt_xent", n=19, d=16, dtype=torch.bfloat16, scale=2.0,
                    regime="correlated"),
    "siglip": Case(loss="siglip", n=37, d=16, dtype=torch.bfloat16, scale=10.0, bias=-10.0,
                   regime="correlated"),
}
WITH_REDUCTION = ["clip", "info_nce", "nt_xent"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", WITH_REDUCTION)
def test_reductions(loss, backend):
    """"none" is the per-row vector (each value against the reference), "sum" its sum, "mean"
    its mean over all rows; the gradients scale the same way."""
    case = BASE[loss]
    results = {r: check_case(replace(case, reduction=r), backend)  # each against the reference
               for r in ("none", "sum", "mean")}
    assert results["none"].loss.shape == (case.rows,)
    assert results["sum"].loss.shape == results["mean"].loss.shape == ()
    torch.testing.assert_close(results["sum"].loss, results["none"].loss.sum())
    torch.testing.assert_close(results["mean"].loss, results["none"].loss.mean())
    assert _changed(results["sum"].loss, results["mean"].loss)
    assert _changed(results["none"].loss, results["mean"].loss.expand(case.rows))
    for name, grad in results["sum"].grads.items():
        if loss == "clip" and name == "bias":
            continue
        # bf16 gradients of differently scaled dX: equal up to their rounding
        assert rel_err(results["mean"].grads[name] * case.rows, grad) < 1e-2, name


def _spy_backends(monkeypatch) -> list[str]:
    """Records the backend every engine call runs on ("materialized" for its own path; SigLIP's
    chunked Triton path, which forms its gradients in the forward, counts as both calls; fp32
    InfoNCE's, the LM head's training path, as one per call)."""
    seen = []
    for name in ("row_stats", "grads"):
        original = getattr(engine, name)

        def spy(*args, _original=original, **kwargs):
            seen.append(kwargs["plan"].backend if "plan" in kwargs else kwargs.get("backend"))
            return _original(*args, **kwargs)

        monkeypatch.setattr(engine, name, spy)
    for name in ("forward", "backward"):
        original = getattr(materialized, name)

        def spy_materialized(*args, _original=original):
            seen.append("materialized")
            return _original(*args)

        monkeypatch.setattr(materialized, name, spy_materialized)
    from fusedloss.core import chunked_contrastive

    original_chunked = chunked_contrastive.siglip_loss_and_grads

    def spy_chunked(*args):  # SigLIP's Triton path: forward and backward in one call
        seen.extend(["triton", "triton"])
        return original_chunked(*args)

    monkeypatch.setattr(chunked_contrastive, "siglip_loss_and_grads", spy_chunked)
    from fusedloss.core import chunked_logits

    original_lm_head = chunked_logits.loss_and_grads

    # fp32 InfoNCE's Triton path; at few rows its gradient is formed in a second call
    def spy_lm_head(*args, **kwargs):
        seen.append("triton")
        return original_lm_head(*args, **kwargs)

    monkeypatch.setattr(chunked_logits, "loss_and_grads", spy_lm_head)
    return seen


@pytest.mark.parametrize("loss", LOSSES)
def test_backend_option_selects_the_engine(monkeypatch, loss):
    """backend= reaches the engine (forward and backward); "auto" is the materialized path on
    CUDA at this size, torch on the CPU; every backend gives the same numbers."""
    seen = _spy_backends(monkeypatch)
    case = replace(BASE[loss], dtype=torch.float32)
    problem = make_problem(case)
    results = {}
    backends = ["torch", "auto"] + (["triton", "materialized"] if can_run_triton() else [])
    for backend in backends:
        seen.clear()
        results[backend] = run_ours(case, problem, backend)
        expected = ("materialized" if ON_GPU else "torch") if backend == "auto" else backend
        assert seen == [expected, expected], f"backend={backend!r} ran on {seen}"
    for backend in ("triton", "materialized"):
        if backend in results:
            fused, chunked = results[backend], results["torch"]
            torch.testing.assert_close(fused.loss, chunked.loss, rtol=2e-5, atol=2e-5)
            for name, grad in chunked.grads.items():  # fp32: a cancelling ds may differ by 1e-5
                assert rel_err(fused.grads[name], grad) < 1e-4, (backend, name)


def test_auto_materializes_up_to_the_tuned_bytes(tune):
    """The rule of ``resolve_backend``: "auto" on CUDA materializes while N·M elements of the
    features' dtype fit ``Tuning.materialized_bytes``, and takes the tiled kernels beyond."""
    resolve = fusedloss.losses.contrastive.resolve_backend
    a, b = torch.empty(64, 8, device="meta"), torch.empty(32, 8, device="meta")
    tune(materialized_bytes=64 * 32 * 4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "resolve_backend", lambda backend, device: "triton")
        assert resolve("auto", a, b) == "materialized"
        assert resolve("auto", a, torch.empty(33, 8, device="meta")) == "triton"
        assert resolve("auto", a.bfloat16(), torch.empty(64, 8, device="meta")) == "materialized"
        assert resolve("triton", a, b) == "triton"


# Several slabs on either machine: the interpreter's tiles are 16 columns wide, a GPU's 128.
_SLABS = {"scratch_mb": 0.004 if not ON_GPU else 0.5}  # many slabs


@requires_triton
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("loss", ["clip", "info_nce", "nt_xent"])
def test_split_accumulator(monkeypatch, tune, loss, split):
    """Tuning.split_accumulator: dA summed over many slabs as a bf16 pair meets the bar as
    the fp32 accumulator does, and the split kernel runs exactly when asked for."""
    from fusedloss.core import lse_backward

    tune(**_SLABS, split_accumulator=split)
    used = launches_of(monkeypatch, lse_backward, "_accumulate_split_kernel")
    n = 300 if ON_GPU else 40
    case = Case(loss=loss, n=n // 2 if loss == "nt_xent" else n, d=64 if ON_GPU else 16,
                dtype=torch.bfloat16, scale=1 / 0.07, regime="correlated",
                keys=n + 37 if loss == "info_nce" else None)
    check_case(case, "triton")
    assert bool(used) == split


@requires_triton
@pytest.mark.parametrize("loss", ["clip", "info_nce"])
def test_recompute_groups_cover_every_tile(monkeypatch, tune, loss):
    """The recompute's programs sweep the tiles in groups of row blocks
    (``engine.RECOMPUTE_GROUP_BYTES``): groups of one and of three row blocks (a shorter last
    group) give the same gradients, bit for bit, as one group over every row block, over
    slabs of several tiles — a tile mapped twice or never would change them."""
    # Slabs of three tiles (16 columns) on the interpreter, two (128 columns) on a GPU.
    tune(scratch_mb=0.16 if ON_GPU else 0.0075)
    n = 300 if ON_GPU else 70  # five row blocks of 64 or 16
    case = Case(loss=loss, n=n, d=64 if ON_GPU else 16, dtype=torch.bfloat16, scale=1 / 0.07,
                regime="correlated", keys=n + 37 if loss == "info_nce" else None)
    cfg = config.backward_config(torch.device(DEVICE), case.dtype, case.d)
    block_bytes = cfg.block_m * case.d * case.dtype.itemsize
    assert math.ceil(n / cfg.block_m) % 3 != 0  # the last group of three is shorter
    problem = make_problem(case)
    results = {}
    for rows in (1, 3, 10**6):
        monkeypatch.setattr(engine, "RECOMPUTE_GROUP_BYTES", rows * block_bytes)
        results[rows] = run_ours(case, problem, "triton")
    check_against_reference(case, problem, results[3], run_torch_same_dtype(case, problem),
                            run_reference(case, problem), "triton")
    for rows in (1, 3):
        assert torch.equal(results[rows].loss, results[10**6].loss)
        for name, grad in results[10**6].grads.items():
            assert torch.equal(results[rows].grads[name], grad), (rows, name)


@requires_cuda
def test_split_accumulator_halves_the_accumulator(tune):
    """The split pair takes 2·N·D bytes where the fp32 accumulator took 4·N·D."""
    n, d = 4096, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, y = (F.normalize(torch.randn(n, d, device="cuda", generator=gen), dim=1)
            .bfloat16().requires_grad_() for _ in range(2))
    tune(**_SLABS)
    peaks = {}
    for split in (False, True):
        tune(split_accumulator=split)
        x.grad = y.grad = None
        loss = fusedloss.clip_loss(x, y, 1 / 0.07, backend="triton")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        peaks[split] = torch.cuda.max_memory_allocated() - base
    assert peaks[True] <= peaks[False] - 0.9 * 2 * n * d, peaks


# Every slab through the block-sparse path (which the contrastive losses take only on request).
SPARSE = {"dense_slab_fraction": 2.0, "sparse_slabs": True}


def filter_case(loss: str, **changes) -> Case:
    """Clustered features at CLIP's initial scale 1/0.07, several clusters (and tiles) wide:
    each row's softmax lives in its cluster's tile, with a tail of about 1% in the others.

    filter_eps bounds each row's skipped mass *relative to its gradient mass* 2(1 − P_ii), so
    a large eps skips tiles only where that tail is not negligible against the gradient:
    correlated pairs at scale 100 put ~e^-40 in every other tile, and skipping it changes
    nothing measurable; here eps = 0.5 drops the tail (a few % of the gradient).
    """
    n = 2 * _CLUSTER if loss == "nt_xent" else 3 * _CLUSTER
    case = Case(loss=loss, n=n, d=16, dtype=torch.bfloat16, scale=1 / 0.07, regime="clustered",
                cluster=_CLUSTER, keys=n + 5 if loss == "info_nce" else None, filter_eps=None)
    return replace(case, **changes)


@requires_triton
@pytest.mark.parametrize("tuning", [pytest.param({}, id="defaults"),
                                    pytest.param(SPARSE, id="sparse", marks=pytest.mark.slow)])
@pytest.mark.parametrize("loss", WITH_REDUCTION)
def test_filter_eps(tune, loss, tuning):
    """filter_eps is wired in: a large eps (0.5) moves the gradients measurably, None computes
    every tile (the reference within rounding), "auto" meets the bar; the forward never
    filters. For fp32 "auto" is exact: it equals None bit for bit."""
    tune(**tuning)
    case = filter_case(loss)
    problem = make_problem(case)
    exact = run_ours(case, problem, "triton")
    huge = run_ours(replace(case, filter_eps=0.5), problem, "triton")
    check_against_reference(case, problem, exact, run_torch_same_dtype(case, problem),
                            run_reference(case, problem), "triton")
    for name, grad in exact.grads.items():  # same path, same rounding: a skipped tile
        assert rel_err(huge.grads[name], grad) > 3e-3, (
            f"filter_eps=0.5 left grad {name} unchanged: no tile was skipped")
    assert torch.equal(huge.loss, exact.loss)
    check_case(replace(case, filter_eps="auto"), "triton")
    fp32 = replace(case, dtype=torch.float32)
    problem32 = make_problem(fp32)
    auto, none = (run_ours(replace(fp32, filter_eps=eps), problem32, "triton")
                  for eps in ("auto", None))
    assert torch.equal(auto.loss, none.loss)
    for name, grad in none.grads.items():
        assert torch.equal(auto.grads[name], grad), name


@pytest.mark.parametrize("backend", BACKENDS_SLOW_TRITON)
def test_info_nce_labels(backend):
    """Explicit labels pick each query's positive key: a permutation changes the result and
    matches the reference; labels=arange(N) equals labels=None; M > N keys (a queue) work."""
    case = replace(BASE["info_nce"], dtype=torch.float32)
    ours = check_case(case, backend)  # permuted labels into 53 keys, against the reference
    problem = make_problem(case)
    default = run_ours(case, replace(problem, labels=None), backend)
    assert _changed(ours.loss, default.loss) and _changed(ours.grads["a"], default.grads["a"])
    arange = torch.arange(case.n, device=DEVICE)
    explicit = run_ours(case, replace(problem, labels=arange), backend)
    assert torch.equal(explicit.loss, default.loss)
    assert torch.equal(explicit.grads["b"], default.grads["b"])
    check_case(replace(case, labels=False), backend)  # M > N, labels None: keys 0..N-1
    for dtype in (torch.int32, torch.int64):  # any integer dtype
        loss = fusedloss.info_nce_loss(problem.a, problem.b, problem.labels.to(dtype),
                                       temperature=0.07, backend=backend)
        torch.testing.assert_close(loss, ours.loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS_SLOW_TRITON)
@pytest.mark.parametrize("loss", ["info_nce", "nt_xent"])
def test_temperature(loss, backend):
    """A float and a tensor give the same loss; the tensor gets the reference's gradient; the
    value is used (it changes the loss) and the default is the documented one."""
    case = replace(BASE[loss], dtype=torch.float32, scale=10.0)
    problem = make_problem(case)
    as_tensor = check_case(case, backend)  # includes the temperature gradient
    assert as_tensor.grads["temperature"].shape == ()
    as_float = run_ours(replace(case, learn=False), problem, backend)
    assert torch.equal(as_float.loss, as_tensor.loss)
    other = run_ours(replace(case, scale=3.0), problem, backend)
    assert _changed(other.loss, as_float.loss)
    one_element = torch.tensor([0.1], device=DEVICE)  # a (1,) tensor is a scalar too
    if loss == "info_nce":
        default = fusedloss.info_nce_loss(problem.a, problem.b, problem.labels, backend=backend)
        documented = 0.07
        shaped = fusedloss.info_nce_loss(problem.a, problem.b, problem.labels,
                                         temperature=one_element, backend=backend)
    else:
        default = fusedloss.nt_xent_loss(problem.a, backend=backend)
        documented = 0.5
        shaped = fusedloss.nt_xent_loss(problem.a, one_element, backend=backend)
    explicit = run_ours(replace(case, scale=1 / documented, learn=False), problem, backend)
    assert torch.equal(default, explicit.loss)
    torch.testing.assert_close(shaped, as_float.loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_logit_bias_changes_nothing(backend):
    """A scalar bias shifts every logit, which no softmax sees: the loss and the feature
    gradients are those without it (up to rounding) and its own gradient is exactly 0, as
    documented; a float bias is accepted too."""
    case = replace(BASE["clip"], reduction="none", bias=25.0)  # far from 0: not a no-op
    problem = make_problem(case)
    with_bias = check_case(case, backend)
    without = run_ours(replace(case, bias=None), problem, backend)
    torch.testing.assert_close(with_bias.loss, without.loss, rtol=1e-5, atol=1e-6)
    for name, grad in without.grads.items():
        assert rel_err(with_bias.grads[name], grad) < 1e-5, name
    assert with_bias.grads["bias"].item() == 0.0
    as_float = run_ours(replace(case, learn=False), problem, backend)
    torch.testing.assert_close(as_float.loss, with_bias.loss, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_siglip_logit_bias(backend):
    """The bias enters every logit: it changes the loss, its gradient matches the reference
    (check_case), and a float bias gives the tensor's loss."""
    case = BASE["siglip"]
    problem = make_problem(case)
    ours = check_case(case, backend)
    assert ours.grads["bias"].abs().item() > 0
    assert _changed(run_ours(replace(case, bias=0.0), problem, backend).loss, ours.loss)
    assert torch.equal(run_ours(replace(case, learn=False), problem, backend).loss, ours.loss)


@pytest.mark.parametrize("reduction, formed", [
    ("mean", "backward"), pytest.param("sum", "backward", marks=pytest.mark.slow),
    pytest.param("mean", "forward, chunks", marks=pytest.mark.slow)])
def test_fp32_info_nce_takes_the_lm_head_training_path(monkeypatch, tune, reduction, formed):
    """A reduced fp32 InfoNCE on the Triton backend runs on the LM head's training path, with
    the reference's loss and gradients (the temperature's too; labels, N ≠ M), its gradients
    formed in the backward (few rows) or in the forward over chunks of rows; per-row losses
    and bf16 features keep the tiled kernels; a bad label gives NaN, or the labels' error."""
    if not can_run_triton():
        pytest.skip("needs the Triton kernels")
    if formed != "backward":
        tune(lm_head_deferred_rows=0, lm_head_chunk_bytes=16 * 53 * 4)  # chunks of 16 rows
    from fusedloss.core import chunked_logits

    calls = []
    original = chunked_logits.loss_and_grads

    def spy(*args, **kwargs):
        calls.append(args[0].dtype)
        return original(*args, **kwargs)

    monkeypatch.setattr(chunked_logits, "loss_and_grads", spy)
    case = replace(BASE["info_nce"], dtype=torch.float32, reduction=reduction)
    check_case(case, "triton")
    assert calls and set(calls) == {torch.float32}
    calls.clear()
    run_ours(replace(case, reduction="none"), make_problem(case), "triton")
    bf16 = replace(case, dtype=torch.bfloat16)
    run_ours(bf16, make_problem(bf16), "triton")
    assert calls == []
    problem = make_problem(case)  # no label is an ignore_index here: NaN, as elsewhere
    for bad in (-100, -1, 53, torch.iinfo(torch.int64).min):
        labels = problem.labels.clone()
        labels[1] = bad
        loss = fusedloss.info_nce_loss(problem.a, problem.b, labels, reduction=reduction,
                                       backend="triton")
        assert calls and loss.isnan(), bad
    tune(check_values=True)
    with pytest.raises(ValueError, match=r"labels holds 53, outside \[0, M\)"):
        fusedloss.info_nce_loss(problem.a, problem.b, torch.full_like(labels, 53),
                                reduction=reduction, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_create_graph_gives_the_first_order_gradients(dtype):
    """``create_graph=True`` (a gradient penalty's first step) gives the same gradients as a
    plain backward, on every path an InfoNCE call may take."""
    if not can_run_triton():
        pytest.skip("needs the Triton kernels")
    problem = make_problem(replace(BASE["info_nce"], dtype=dtype))
    q = problem.a.detach().requires_grad_()
    grads = []
    for create_graph in (False, True):
        loss = fusedloss.info_nce_loss(q, problem.b, problem.labels, backend="triton")
        grads.append(torch.autograd.grad(loss, q, create_graph=create_graph)[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow),
                                   torch.bfloat16])
def test_siglip_in_chunks_of_rows(dtype, tune):
    """SigLIP's Triton training path in chunks of 48 rows (the last one short, D not a multiple
    of the tile): the reference's loss and gradients (check_case) in one chunk, and the same
    in chunks."""
    case = replace(BASE["siglip"], n=100, d=24, dtype=dtype)
    whole = check_case(case, "triton")
    tune(lm_head_chunk_bytes=48 * case.n * dtype.itemsize)
    chunked = run_ours(case, make_problem(case), "triton")
    torch.testing.assert_close(chunked.loss, whole.loss, rtol=1e-6, atol=0)
    for name, grad in whole.grads.items():
        torch.testing.assert_close(chunked.grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_logit_scale(kind, backend):
    """logit_scale is used as given (already exp()-ed): doubling it changes the loss, a float
    and a (1,)-shaped tensor give the 0-dim tensor's loss."""
    case = BASE[kind]
    problem = make_problem(case)
    ours = run_ours(case, problem, backend)
    assert _changed(run_ours(replace(case, scale=2 * case.scale), problem, backend).loss,
                    ours.loss)
    assert torch.equal(run_ours(replace(case, learn=False), problem, backend).loss, ours.loss)
    fn = fusedloss.clip_loss if kind == "clip" else fusedloss.siglip_loss
    shaped = fn(problem.a, problem.b, torch.tensor([case.scale], device=DEVICE), case.bias,
                backend=backend)
    assert torch.equal(shaped, ours.loss)


# ---------------------------------------------------------------------------------------------
# modules


def _module_call(module, case: Case, problem: Problem, leaves: dict, output_dict=False):
    if case.loss in ("clip", "siglip"):
        return module(leaves["a"], leaves["b"], leaves["scale"], leaves.get("bias"),
                      output_dict=output_dict)
    if case.loss == "info_nce":
        return module(leaves["a"], leaves["b"], problem.labels)
    return module(leaves["a"])


MODULES = {"clip": ClipLoss, "siglip": SigLipLoss, "info_nce": InfoNCELoss,
           "nt_xent": NTXentLoss}
MODULE_OPTIONS = [
    pytest.param("clip", dict(reduction="sum"), id="clip-reduction"),
    pytest.param("clip", dict(filter_eps=0.5), id="clip-filter_eps"),
    pytest.param("info_nce", dict(temperature=0.2), id="info_nce-temperature"),
    pytest.param("info_nce", dict(reduction="none"), id="info_nce-reduction"),
    pytest.param("info_nce", dict(filter_eps=0.5), id="info_nce-filter_eps"),
    pytest.param("nt_xent", dict(temperature=0.2), id="nt_xent-temperature"),
    pytest.param("nt_xent", dict(reduction="sum"), id="nt_xent-reduction"),
    pytest.param("nt_xent", dict(filter_eps=0.5), id="nt_xent-filter_eps"),
]


@pytest.mark.parametrize("loss, option", MODULE_OPTIONS)
def test_module_forwards_every_option(loss, option):
    """Module(option) equals the functional call with that option, bit for bit, and differs
    from the module without it (filter_eps on Triton and peaked inputs)."""
    backend = "triton" if "filter_eps" in option else "torch"
    if backend == "triton" and not can_run_triton():
        pytest.skip("backend='triton' needs a CUDA device or TRITON_INTERPRET=1")
    case = filter_case(loss, reduction=option.get("reduction", "mean"),
                       filter_eps=option.get("filter_eps", "auto"),
                       learn=loss == "clip")  # the modules take a float temperature
    if "temperature" in option:
        case = replace(case, scale=1 / option["temperature"])
    problem = make_problem(case)
    module_kwargs = dict(option, backend=backend)
    if "temperature" not in option and loss in ("info_nce", "nt_xent"):
        module_kwargs["temperature"] = 1 / case.scale
    module = MODULES[loss](**module_kwargs)
    default_kwargs = {k: v for k, v in module_kwargs.items() if k not in option}
    leaves = _leaves(case, problem)
    with_option = _result(_module_call(module, case, problem, leaves), leaves, case)
    functional = run_ours(case, problem, backend)
    assert torch.equal(with_option.loss, functional.loss)
    for name, grad in functional.grads.items():
        assert torch.equal(with_option.grads[name], grad), name
    leaves = _leaves(case, problem)
    default_case = replace(case, reduction="mean", filter_eps="auto")
    without = _result(_module_call(MODULES[loss](**default_kwargs), case, problem, leaves),
                      leaves, default_case)
    changed = _changed(with_option.loss, without.loss) or any(
        _changed(with_option.grads[name], without.grads[name]) for name in ("a",))
    assert changed, f"{option} changes nothing: the module may be dropping it"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_module_output_dict(kind, backend):
    """output_dict=True returns {"contrastive_loss": loss} (open_clip), the same loss and
    gradients as the plain call and the functional form."""
    case = BASE[kind]
    problem = make_problem(case)
    module = MODULES[kind](backend=backend)
    leaves = _leaves(case, problem)
    out = _module_call(module, case, problem, leaves, output_dict=True)
    assert isinstance(out, dict) and list(out) == ["contrastive_loss"]
    as_dict = _result(out["contrastive_loss"], leaves, case)
    leaves = _leaves(case, problem)
    plain_out = _module_call(module, case, problem, leaves)
    assert isinstance(plain_out, torch.Tensor)
    plain = _result(plain_out, leaves, case)
    functional = run_ours(case, problem, backend)
    for other in (plain, functional):
        assert torch.equal(as_dict.loss, other.loss)
        for name, grad in other.grads.items():
            assert torch.equal(as_dict.grads[name], grad), name


def test_clip_module_accepts_open_clip_arguments():
    """open_clip's constructor arguments (single process) are accepted and change nothing."""
    case = BASE["clip"]
    problem = make_problem(case)
    plain = ClipLoss(backend="torch")(problem.a, problem.b, case.scale)
    configured = ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True, rank=0,
                          world_size=1, backend="torch")
    assert torch.equal(configured(problem.a, problem.b, case.scale), plain)
    siglip = SigLipLoss(cache_labels=True, rank=0, world_size=1, backend="torch")
    expected = fusedloss.siglip_loss(problem.a, problem.b, 10.0, -10.0, backend="torch")
    assert torch.equal(siglip(problem.a, problem.b, 10.0, -10.0), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nt_xent_module_two_views(backend):
    """NTXentLoss()(z1, z2) equals NTXentLoss()(cat([z1, z2])), loss and gradients, and the
    functional nt_xent_loss; swapping the views gives the same mean."""
    case = replace(BASE["nt_xent"], learn=False)
    problem = make_problem(case)
    module = NTXentLoss(temperature=0.5, backend=backend)
    z = problem.a.detach().clone().requires_grad_()
    stacked = module(z)
    stacked.backward()
    z1, z2 = (t.detach().clone().requires_grad_() for t in problem.a.chunk(2))
    pair = module(z1, z2)
    pair.backward()
    assert torch.equal(pair, stacked)
    assert torch.equal(torch.cat([z1.grad, z2.grad]), z.grad)
    functional = fusedloss.nt_xent_loss(problem.a, 0.5, backend=backend)
    assert torch.equal(functional, stacked)
    swapped = module(*reversed(problem.a.detach().chunk(2)))
    torch.testing.assert_close(swapped, stacked, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------
# invariants and edge cases


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", LOSSES)
def test_nan_input_gives_nan_loss(loss, backend):
    """A NaN feature poisons the loss (and the rows it reaches), nothing crashes, forward or
    backward, with filtering on (bf16)."""
    case = replace(BASE[loss], reduction="none" if loss != "siglip" else "mean")
    problem = make_problem(case)
    problem.a[5, 3] = float("nan")
    ours = run_ours(case, problem, backend)
    assert torch.isnan(ours.loss).any()
    if loss == "info_nce":  # a query row reaches only its own loss
        assert torch.isnan(ours.loss[5])
        others = torch.ones(case.rows, dtype=torch.bool, device=ours.loss.device)
        others[5] = False
        assert torch.isfinite(ours.loss[others]).all(), "a NaN query leaked into other rows"
    mean = run_ours(replace(case, reduction="mean"), problem, backend).loss
    assert torch.isnan(mean)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", [pytest.param(t, id=n) for n, t in DTYPES.items()])
def test_huge_logits_stay_finite(loss, dtype, backend):
    """Logits in the tens of thousands (unnormalized features × scale 100): finite loss and
    gradients, per-row losses ≥ 0."""
    case = replace(BASE[loss], dtype=dtype, scale=100.0, reduction="none" if loss != "siglip"
                   else "mean", learn=False)
    problem = make_problem(case)
    problem.a *= 20
    if problem.b is not None:
        problem.b *= 20
    ours = run_ours(case, problem, backend)
    check_invariants(case, problem, ours)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", LOSSES)
def test_no_grad_and_partial_grads(loss, backend):
    """Under no_grad the loss is the same; gradients not asked for stay None and the others
    do not change."""
    case = BASE[loss]
    problem = make_problem(case)
    full = run_ours(case, problem, backend)
    with torch.no_grad():
        again = call_ours(case, problem, _leaves(case, problem), backend)
    assert torch.equal(again, full.loss)
    leaves = _leaves(case, problem)
    for name, leaf in leaves.items():
        if name != "a" and isinstance(leaf, torch.Tensor):
            leaf.requires_grad_(False)
    _result(call_ours(case, problem, leaves, backend), {"a": leaves["a"]}, case)
    assert torch.equal(leaves["a"].grad, full.grads["a"])
    assert all(t.grad is None for k, t in leaves.items() if k != "a")


@pytest.mark.skipif(not can_run_triton(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_clip_column_far_below_its_tile_is_folded_exactly():
    """One text whose similarities all lie ~75 below the largest logit of its diagonal tile
    (scale 100, the other pairs matched at cosine 1): its column statistics must use its own
    max, since column sums formed relative to the tile's max underflow there."""
    gen = torch.Generator().manual_seed(0)
    n, d = 40, 16
    images = F.normalize(torch.randn(n, d, generator=gen), dim=-1)
    texts = images.clone()
    texts[5] = F.normalize(torch.randn(d, generator=gen), dim=-1)
    images, texts = images.bfloat16(), texts.bfloat16()
    a = images.to(DEVICE, copy=True).requires_grad_()
    b = texts.to(DEVICE, copy=True).requires_grad_()
    ours = fusedloss.clip_loss(a, b, 100.0, reduction="sum", backend="triton")
    ours.backward()
    a64 = images.double().requires_grad_()
    b64 = texts.double().requires_grad_()
    ref = clip_loss_ref(a64, b64, 100.0, reduction="sum")
    ref.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)
    assert rel_err(a.grad, a64.grad) < 1e-2
    assert rel_err(b.grad, b64.grad) < 1e-2


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("n, m", [(7, 7), (5, 12), (1, 4)])
def test_off_diagonal_margins_leave_each_rows_own_column_out(n, m, backend):
    """``losses.contrastive.off_diagonal_margins``: LSE_{j≠i} s·q_i·k_j − s·q_i·k_t per row, a
    query against keys that hold its own at column i (rectangular too), values and gradients
    against the masked float64 logits."""
    from fusedloss.losses import contrastive

    g = torch.Generator().manual_seed(n * m)
    q, k = torch.randn(n, 16, generator=g), torch.randn(m, 16, generator=g)
    target = (torch.arange(n) + 1) % m
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k)]
    got = contrastive.off_diagonal_margins(*leaves, target.to(DEVICE), 3.0, backend)
    ref = [t.double().requires_grad_() for t in (q, k)]
    x = 3.0 * ref[0] @ ref[1].T
    masked = x.masked_fill(torch.eye(n, m, dtype=torch.bool), float("-inf"))
    want = torch.logsumexp(masked, 1) - x[torch.arange(n), target]
    torch.testing.assert_close(got.cpu().double(), want.detach(), rtol=1e-5, atol=1e-5)
    weights = torch.linspace(0.5, 1.5, n)
    for x_, r in zip(torch.autograd.grad((got * weights.to(DEVICE)).sum(), leaves),
                     torch.autograd.grad((want * weights.double()).sum(), ref), strict=True):
        torch.testing.assert_close(x_.cpu().double(), r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("positives", [True, False])
def test_siglip_chunks_without_positives_into_an_accumulator(tune, positives):
    """SigLIP's Triton path with ``positives=False`` (every pair a negative: the ring's blocks
    of other ranks' texts) and ``acc_a`` (dA added into an fp32 accumulator), over three
    chunks of rows and N ≠ M, against float64."""
    if not can_run_triton():
        pytest.skip("needs the Triton kernels (a GPU or TRITON_INTERPRET=1)")
    from fusedloss.core import chunked_contrastive

    g = torch.Generator().manual_seed(5)
    n, m, d = 37, 29, 16
    a, b = [(torch.randn(rows, d, generator=g) / 2).to(DEVICE) for rows in (n, m)]
    scale, bias = torch.tensor(3.0, device=DEVICE), torch.tensor(-2.0, device=DEVICE)
    leaves = [t.double().requires_grad_() for t in (a, b, scale, bias)]
    ref = siglip_loss_ref(*leaves, positives=positives)
    ref_grads = torch.autograd.grad(ref, leaves)
    tune(lm_head_chunk_bytes=16 * m * 8)  # 16 rows a chunk: three chunks
    acc = torch.full((n, d), 0.5, device=DEVICE)  # an earlier block's part
    loss, grad_a, grad_b, grad_bias, grad_scale = chunked_contrastive.siglip_loss_and_grads(
        a, b, scale, bias, 1.0 / n, engine.Needs(True, True, True, True),
        positives=positives, acc_a=acc)
    assert grad_a is acc
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=0)
    for got, want in zip((grad_a - 0.5, grad_b, grad_scale, grad_bias), ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


@given(n=st.integers(1, 300_000), m=st.integers(1, 300_000), element_size=st.sampled_from([2, 4]),
       budget=st.sampled_from([2**16, 2**20, 2**27, 2**30]))
def test_siglip_chunk_shape(n, m, element_size, budget):
    """The Gluon SigLIP path's chunks of G (``chunked_contrastive.chunk_shape``): whole rows
    while at least COLUMN_CHUNK_BELOW fit in the budget, else COLUMN_CHUNK_ROWS rows and the
    columns that fit; whole 64-row and 64-column tiles but for the last; within the budget
    wherever a 64 × 64 tile is."""
    from fusedloss.core import chunked_contrastive as cc

    rows, cols = cc.chunk_shape(n, m, element_size, budget)
    assert 1 <= rows <= n and 1 <= cols <= m
    assert rows == n or rows % 64 == 0
    assert cols == m or cols % 64 == 0
    padded = -(-rows // 64) * 64 * (-(-cols // 64) * 64) * element_size
    whole_rows = min(n, budget // (element_size * (-(-m // 64) * 64)))
    if cols < m:  # column chunks only for wide batches, at their fixed rows
        assert whole_rows < cc.COLUMN_CHUNK_BELOW < n
        assert rows == min(n, cc.COLUMN_CHUNK_ROWS)
        assert padded <= budget or cols == 64
    elif rows < n:  # whole rows (a batch this narrow has no columns to split)
        assert whole_rows >= cc.COLUMN_CHUNK_BELOW or n <= cc.COLUMN_CHUNK_BELOW or m <= 64
        assert padded <= budget or rows == 64
    else:  # all of it in one chunk: it fits, or less than a tile's rows would
        assert whole_rows >= n or n <= 64


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] != "materialized"])
@pytest.mark.parametrize("case", ["in order", "bias", "some rows"])
def test_grads_add_into_acc_a_and_write_out_b(backend, case):
    """``engine.grads(acc_a=, out_b=)`` (the ring's): dA is added to the caller's fp32
    accumulator, which comes back as Grads.a, and dB is written into the caller's buffer —
    where the products go straight into the accumulator (every row in order, no bias) and
    where they cannot (a bias's post-scale; a subset of the rows)."""
    from fusedloss.families import contrastive as family

    gen = torch.Generator().manual_seed(5)
    n, m, d = 37, 45, 32
    a = torch.randn(n, d, generator=gen).to(DEVICE)
    b = torch.randn(m, d, generator=gen).to(DEVICE)
    scale = torch.tensor(3.0, device=DEVICE)
    bias = torch.tensor(-1.0, device=DEVICE) if case == "bias" else None
    index = torch.arange(n, device=DEVICE) if case != "some rows" else \
        torch.arange(0, n, 2, device=DEVICE)
    rows = engine.Rows(index=index, n_valid=torch.full((), index.numel(), device=DEVICE),
                       target=index % m, identity=case != "some rows", all_valid=True)
    logits = family.logits("info_nce", b, scale, bias)
    stats = engine.row_stats(a, b, logits, rows, backend=backend)
    g = torch.rand(index.numel(), generator=gen).to(DEVICE)
    coef = family.grad_coefficients("info_nce", g, g)
    plan = engine.BackwardPlan(grad_dtype=torch.float32, backend=backend)
    needs = engine.Needs(True, True, bias is not None, True)
    plain = engine.grads(a, b, logits, rows, stats, coef, needs=needs, plan=plan)
    start = torch.randn(n, d, generator=gen).to(DEVICE)
    acc, out = start.clone(), torch.full((m, d), float("nan"), device=DEVICE)
    got = engine.grads(a, b, logits, rows, stats, coef, needs=needs, plan=plan, acc_a=acc,
                       out_b=out)
    assert got.a is acc and got.b is out
    torch.testing.assert_close(acc, start + plain.a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, plain.b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.scale, plain.scale)
    with pytest.raises(ValueError, match="acc_a"):
        engine.grads(a, b, logits, rows, stats, coef, needs=needs, plan=plan, acc_a=acc.half())
    with pytest.raises(ValueError, match="out_b"):
        engine.grads(a, b, logits, rows, stats, coef, needs=needs, plan=plan, out_b=out[:, :8])
