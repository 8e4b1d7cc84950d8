"""StableAdamW against a float64 transcription of the paper's Algorithm 2 (Wortsman et al. 2023).

The reference below keeps the paper's debiased-β̂ moments (v_t, u_t); the optimizer keeps Adam's
biased moments and corrects on the fly, so agreement checks the two formulations too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import pytest
import torch
from helpers import can_run_triton, requires_cuda
from hypothesis import given
from hypothesis import strategies as st

from fusedloss.core import config
from fusedloss.optim import StableAdamW

SHAPES = [(7, 5), (13,), (3, 4, 2), (1,)]


def algorithm2_step(theta, g, v, u, t, *, lr, betas, eps, weight_decay, clip_threshold=1.0,
                    clip=True, clip_weight_decay=False):
    """One step of Algorithm 2 in float64 for one tensor; returns (theta, v, u, rms)."""
    beta1, beta2 = betas
    beta1_hat = beta1 * (1 - beta1 ** (t - 1)) / (1 - beta1**t)
    beta2_hat = beta2 * (1 - beta2 ** (t - 1)) / (1 - beta2**t)
    v = beta1_hat * v + (1 - beta1_hat) * g
    u = beta2_hat * u + (1 - beta2_hat) * g * g
    rms = torch.sqrt(torch.mean(g * g / torch.clamp(u, min=eps**2)))
    eta = lr / max(1.0, rms.item() / clip_threshold) if clip else lr
    decay_rate = eta if clip_weight_decay else lr
    theta = theta - decay_rate * weight_decay * theta - eta * v / (torch.sqrt(u) + eps)
    return theta, v, u, rms.item()


def make_params(seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
            for s in SHAPES]


def gradients(seed: int, steps: int, spike_step: int | None, spike_tensor: int = 0):
    """A float64 gradient per tensor per step; one tensor's gradient ×1000 at spike_step."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for t in range(steps):
        gs = [torch.randn(s, generator=gen, dtype=torch.float64) * (0.1 + 0.05 * i)
              for i, s in enumerate(SHAPES)]
        if t == spike_step:
            gs[spike_tensor] = gs[spike_tensor] * 1000.0
        out.append(gs)
    return out


def two_groups(params, *, lr, betas, eps, weight_decay, clip_weight_decay=False):
    """Two groups with different hyper-parameters: the first two tensors, then the rest."""
    return [
        dict(params=params[:2], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
             clip_weight_decay=clip_weight_decay),
        dict(params=params[2:], lr=lr * 0.5, betas=(0.8, betas[1]), eps=eps,
             weight_decay=weight_decay * 2, clip_weight_decay=clip_weight_decay),
    ]


def run_reference(seed, grads, *, unclipped_steps=(), **hyper):
    """Algorithm 2 over all steps; at the (1-based) ``unclipped_steps`` η = α (plain AdamW)."""
    thetas = [p.detach().double() for p in make_params(seed)]
    groups = two_groups(list(range(len(SHAPES))), **hyper)
    vs = [torch.zeros_like(x) for x in thetas]
    us = [torch.zeros_like(x) for x in thetas]
    rms_history = []
    for t, gs in enumerate(grads, start=1):
        rms_t = []
        for group in groups:
            for i in group["params"]:
                thetas[i], vs[i], us[i], rms = algorithm2_step(
                    thetas[i], gs[i], vs[i], us[i], t, lr=group["lr"], betas=group["betas"],
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    clip=t not in unclipped_steps,
                    clip_weight_decay=group["clip_weight_decay"])
                rms_t.append(rms)
        rms_history.append(rms_t)
    return thetas, rms_history


def run_optimizer(seed, grads, **hyper):
    params = make_params(seed)
    opt = StableAdamW(two_groups(params, **hyper), track_rms=True)
    rms_history = []
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.to(p.dtype)
        opt.step()
        rms_history.append([opt.state[p]["rms"].clone() for p in params])
    return params, opt, rms_history


@given(
    seed=st.integers(0, 2**16),
    beta2=st.sampled_from([0.95, 0.99, 0.999]),
    weight_decay=st.sampled_from([0.0, 0.1]),
    clip_weight_decay=st.booleans(),
    spike_step=st.integers(3, 11),
)
def test_matches_algorithm2_with_a_gradient_spike(
    seed, beta2, weight_decay, clip_weight_decay, spike_step
):
    hyper = dict(lr=1e-2, betas=(0.9, beta2), eps=1e-8, weight_decay=weight_decay,
                 clip_weight_decay=clip_weight_decay)
    grads = gradients(seed, 12, spike_step)
    ref, ref_rms = run_reference(seed, grads, **hyper)
    params, _, rms = run_optimizer(seed, grads, **hyper)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)
    got_rms = torch.tensor([[x.item() for x in step] for step in rms], dtype=torch.float64)
    torch.testing.assert_close(got_rms, torch.tensor(ref_rms, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    # The spike makes RMS_t > 1 in that tensor, so the clipping acts.
    assert ref_rms[spike_step][0] > 1.2
    # First step: u_1 = g_1², so RMS_1 = 1 exactly (up to the ε floor).
    assert all(abs(x - 1.0) < 1e-6 for x in ref_rms[0])


def test_clipping_is_not_ignored():
    """At the spike, the clipped step differs from plain AdamW's by the RMS factor: a version
    that ignored the clipping would match the unclipped reference instead."""
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    grads = gradients(3, 30, spike_step=29)
    clipped, rms = run_reference(3, grads, **hyper)
    unclipped, _ = run_reference(3, grads, unclipped_steps=(30,), **hyper)
    before, _ = run_reference(3, grads[:29], **hyper)
    params, _, _ = run_optimizer(3, grads, **hyper)
    step_ours = params[0].detach().double() - before[0]
    step_adamw = unclipped[0] - before[0]
    assert rms[29][0] > 3.0
    torch.testing.assert_close(step_ours, step_adamw / rms[29][0], rtol=1e-3, atol=2e-6)
    assert (step_ours - step_adamw).abs().max() > 0.5 * step_adamw.abs().max()
    # the other tensors had no spike: their last step is AdamW's
    torch.testing.assert_close(params[1].detach().double(), clipped[1], rtol=1e-5, atol=1e-6)


def test_clip_threshold():
    """η = α / max(1, RMS/d): with d above the spike's RMS the step is plain AdamW's."""
    params = [torch.zeros(64, requires_grad=True)]
    opt = StableAdamW(params, lr=1.0, weight_decay=0.0, clip_threshold=1e6, track_rms=True)
    ref_opt = torch.optim.AdamW([torch.zeros(64, requires_grad=True)], lr=1.0,
                                betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for t in range(10):
        g = torch.randn(64, generator=gen) * (100.0 if t == 9 else 1.0)
        params[0].grad = g.clone()
        ref_opt.param_groups[0]["params"][0].grad = g.clone()
        opt.step()
        ref_opt.step()
    assert opt.state[params[0]]["rms"].item() > 2.0
    torch.testing.assert_close(params[0], ref_opt.param_groups[0]["params"][0],
                               rtol=1e-5, atol=1e-6)


def test_weight_decay_is_decoupled():
    """With zero gradients the update is the decay alone: θ_T = θ_0 (1 - α λ)^T."""
    theta0 = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    p = theta0.clone().requires_grad_()
    opt = StableAdamW([p], lr=0.1, weight_decay=0.5)
    for _ in range(7):
        p.grad = torch.zeros_like(p)
        opt.step()
    torch.testing.assert_close(p.detach(), theta0 * (1 - 0.1 * 0.5) ** 7)


def test_tensor_lr_and_maximize():
    grads = gradients(5, 5, spike_step=2)
    hyper = dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    a, b, c = make_params(5), make_params(5), make_params(5)
    opt_a = StableAdamW(a, lr=1e-2, **hyper)
    opt_b = StableAdamW(b, lr=torch.tensor(1e-2), **hyper)
    opt_c = StableAdamW(c, lr=1e-2, maximize=True, **hyper)
    for gs in grads:
        for pa, pb, pc, g in zip(a, b, c, gs, strict=True):
            pa.grad, pb.grad, pc.grad = g.float(), g.float(), -g.float()
        opt_a.step()
        opt_b.step()
        opt_c.step()
    for pa, pb, pc in zip(a, b, c, strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
        assert torch.equal(pa, pc)


def test_state_dict_round_trip_continues_identically():
    grads = gradients(7, 10, spike_step=6)
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    params, opt, _ = run_optimizer(7, grads[:4], **hyper)
    saved = copy.deepcopy(opt.state_dict())
    clones = [p.detach().clone().requires_grad_() for p in params]
    opt2 = StableAdamW(two_groups(clones, lr=0.5, betas=(0.5, 0.5), eps=1.0, weight_decay=0.0),
                       track_rms=True)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[1]["lr"] == hyper["lr"] * 0.5
    for p in clones:
        assert opt2.state[p]["step"].dtype == torch.float32
        assert opt2.state[p]["step"].item() == 4
    for gs in grads[4:]:
        for p, q, g in zip(params, clones, gs, strict=True):
            p.grad, q.grad = g.float(), g.float()
        opt.step()
        opt2.step()
    for p, q in zip(params, clones, strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step", "rms"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key])


def test_zero_grad_and_missing_grads():
    params = make_params(9)
    opt = StableAdamW(params, lr=1e-2)
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert not torch.equal(params[0], before[0])
    for p, b in zip(params[1:], before[1:], strict=True):
        assert torch.equal(p, b) and p not in opt.state
    opt.zero_grad()
    assert all(p.grad is None for p in params)


@contextlib.contextmanager
def host_reads_forbidden():
    """Inside the block every host read-back of a tensor raises; the test reads its results
    after the block."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("host synchronization: a tensor was read on the host")

    with pytest.MonkeyPatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
            patch.setattr(torch.Tensor, name, refuse)
        yield


def test_step_never_reads_a_tensor_on_the_host():
    """Steps with a tensor lr, clipped weight decay, a gradient spike (the clipping acts) and a
    skip mask read nothing back to the host, and give Algorithm 2's numbers: the skipped tensor
    keeps its parameter and state from step 3, the others take step 4."""
    grads = gradients(11, 4, spike_step=2)
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, clip_weight_decay=True)
    params = make_params(11)
    opt = StableAdamW(two_groups(params, **{**hyper, "lr": torch.tensor(hyper["lr"])}),
                      track_rms=True)
    with host_reads_forbidden():
        for gs in grads[:3]:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.float()
            opt.step()
        kept = params[0].detach().clone()
        kept_state = {k: v.clone() for k, v in opt.state[params[0]].items()}
        for p, g in zip(params, grads[3], strict=True):
            p.grad = g.float()
        params[0].grad.zero_()  # a skipped tensor's gradient is finite (the scaler zeroes it)
        opt.step(skip={p: torch.tensor(i == 0) for i, p in enumerate(params)})
    after3, rms3 = run_reference(11, grads[:3], **hyper)
    after4, rms4 = run_reference(11, grads, **hyper)
    assert rms3[2][0] > 1.2  # the spike's step was clipped
    assert torch.equal(params[0], kept)
    for key, value in kept_state.items():
        assert torch.equal(opt.state[params[0]][key], value), key
    assert opt.state[params[0]]["step"].item() == 3
    torch.testing.assert_close(params[0].detach().double(), after3[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[params[0]]["rms"].double(),
                               torch.tensor(rms3[2][0], dtype=torch.float64), rtol=1e-5, atol=0)
    for i, p in enumerate(params[1:], start=1):
        torch.testing.assert_close(p.detach().double(), after4[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["rms"].double(),
                                   torch.tensor(rms4[3][i], dtype=torch.float64), rtol=1e-5,
                                   atol=1e-6)


BF16_UNIT_ROUNDOFF = 2.0**-8  # bfloat16 keeps 8 significant bits: |fl(x) - x| <= 2^-8 |x|


def update_ratio_bound(betas, t):
    """The largest m̂_t / sqrt(û_t) any gradients give, in Σ_k w_k |g_k| / sqrt(û_t) form.

    m̂_t = Σ_k w_k g_k and û_t = Σ_k v_k g_k² (k = 1..t; w_k = (1 - β1) β1^(t-k) / (1 - β1^t),
    v_k likewise with β2), so by Cauchy-Schwarz Σ_k w_k |g_k| <= sqrt(Σ_k w_k² / v_k) sqrt(û_t).
    """
    beta1, beta2 = betas
    w = [(1 - beta1) * beta1 ** (t - k) / (1 - beta1**t) for k in range(1, t + 1)]
    v = [(1 - beta2) * beta2 ** (t - k) / (1 - beta2**t) for k in range(1, t + 1)]
    return math.sqrt(sum(a * a / b for a, b in zip(w, v, strict=True)))


def test_bfloat16_params():
    """bfloat16 parameters (and moments, kept in the parameter's dtype): Algorithm 2's numbers
    up to the bf16 roundings of the step, entry by entry. To first order in u = 2⁻⁸:

    - the parameter is rounded to bf16 once at the start and twice per step (the decay
      θ (1 - αλ), then θ - η m̂ / (sqrt(û) + ε)): u (|θ_0| + Σ_t |θ_(t-1)| + |θ_t|);
    - the update η m̂ / (sqrt(û) + ε) is formed from bf16 data: the gradient's cast, t lerps into
      m (whose terms can cancel, so each rounding counts against Σ_k w_k |g_k|), the square and
      2t roundings of the second moment, its sqrt, the bias division, the + ε, the division by
      the step size and the RMS_t in η (the same û, a reciprocal and a product): at most
      (3t + 12) u times α Σ_k w_k |g_k| / sqrt(û_t) <= α c_t (``update_ratio_bound``).

    The update reads only gradients, never θ, and the decay shrinks an earlier error, so the
    errors add up. The factor 1 + 1/16 covers the second-order terms (the bf16 trajectory's |θ|
    is within a few percent of the reference's). At lr 1e-2 an entry's update is a few bf16
    ulps of θ: small entries tell a step with the wrong learning rate (half of it fails)."""
    grads = gradients(13, 4, spike_step=2)
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    trajectory = [run_reference(13, grads[:t], **hyper)[0] for t in range(len(grads) + 1)]
    params = make_params(13, torch.bfloat16)
    groups = two_groups(params, **hyper)
    opt = StableAdamW(groups, track_rms=True)
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.to(torch.bfloat16)
        opt.step()
    u, steps = BF16_UNIT_ROUNDOFF, len(grads)
    group_of = {id(p): group for group in groups for p in group["params"]}
    for i, p in enumerate(params):
        assert p.dtype == torch.bfloat16
        assert opt.state[p]["rms"].dtype == torch.float32
        group = group_of[id(p)]
        theta = [x[i].abs() for x in trajectory]
        rounding = u * (theta[0] + sum(theta[t - 1] + theta[t] for t in range(1, steps + 1)))
        update = sum((3 * t + 12) * u * group["lr"] * update_ratio_bound(group["betas"], t)
                     for t in range(1, steps + 1))
        bound = (1 + 1 / 16) * (rounding + update)
        excess = ((p.detach().double() - trajectory[-1][i]).abs() / bound).max().item()
        assert excess <= 1.0, f"tensor {i}: error {excess:.2f}x the rounding bound"


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(eps=-1.0),
                                 dict(weight_decay=-0.1), dict(clip_threshold=0.0)],
                         ids=lambda d: next(iter(d)))
def test_rejects_bad_hyperparameters(bad):
    with pytest.raises(ValueError):
        StableAdamW([torch.zeros(2, requires_grad=True)], **bad)


def test_rms_is_per_tensor_mean():
    """RMS_t of a lone spike entry: mean over the tensor, not the max."""
    p = torch.zeros(100, requires_grad=True)
    opt = StableAdamW([p], lr=1e-3, betas=(0.9, 0.99), track_rms=True)
    for _ in range(5):
        p.grad = torch.ones(100)
        opt.step()
    g = torch.ones(100)
    g[0] = 1e3
    p.grad = g
    opt.step()
    beta2, t = 0.99, 6
    u_hat_0 = ((1 - beta2) * sum(beta2**k for k in range(1, 6))
               + (1 - beta2) * 1e6) / (1 - beta2**t)
    expected = math.sqrt((1e6 / u_hat_0 + 99 * 1.0) / 100)
    assert abs(opt.state[p]["rms"].item() - expected) < 1e-4 * expected


@pytest.mark.parametrize("fused", [None, True], ids=["default", "fused"])
def test_step_compiles_fullgraph_like_eager(fused, device):
    """``torch.compile(optimizer.step, fullgraph=True)``: the same parameters and state as
    eager steps (no host sync breaks the graph), over a few steps with a gradient spike. A
    compiled fused optimizer traces the foreach path; its eager steps run the kernels."""
    if fused and not can_run_triton():
        pytest.skip("Triton kernels need a CUDA device or TRITON_INTERPRET=1")
    device = device if fused else "cpu"
    torch.manual_seed(0)
    shapes = [(4, 3), (3,), (2, 2, 2)]
    grads = [[torch.randn(s) * (50.0 if k == 2 and i == 0 else 1.0) for i, s in
              enumerate(shapes)] for k in range(4)]

    def run(compiled):
        torch.manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s).to(device)) for s in shapes]
        opt = StableAdamW(params, lr=0.1, weight_decay=0.01, track_rms=True, fused=fused)
        step = torch.compile(opt.step, fullgraph=True, backend="aot_eager") if compiled \
            else opt.step
        for g in grads:
            for p, gp in zip(params, g, strict=True):
                p.grad = gp.to(device)
            step()
        return params, opt

    torch._dynamo.reset()
    eager_params, eager_opt = run(False)
    compiled_params, compiled_opt = run(True)
    for p, cp in zip(eager_params, compiled_params, strict=True):
        torch.testing.assert_close(cp, p, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq", "rms"):
            torch.testing.assert_close(compiled_opt.state[cp][key], eager_opt.state[p][key],
                                       rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------
# The fused path (Triton kernels; on the CPU only under TRITON_INTERPRET=1)
# --------------------------------------------------------------------------------------------

# Sizes around the interpreter's 8-element chunks: several chunks, a multiple, one element, none.
FUSED_SHAPES = [(7, 5), (13,), (3, 4, 2), (1,), (0, 3)]
STATE_KEYS = ("exp_avg", "exp_avg_sq", "step", "rms")


def assert_close_to_rounding(ours, ref, ulps=8.0):
    """|ours - ref| within a few float32 ulps of the reference tensor's largest entry: what a
    different summation order in RMS_t and fma contractions leave after a few steps."""
    ours, ref = ours.detach().double().cpu(), ref.detach().double().cpu()
    scale = ref.abs().max().item() if ref.numel() else 0.0
    tol = ulps * torch.finfo(torch.float32).eps * max(scale, torch.finfo(torch.float32).tiny)
    torch.testing.assert_close(ours, ref, rtol=0.0, atol=tol)


def fused_gradients(device, steps, spike_step, missing=()):
    """A gradient per tensor per step (None at the (step, tensor) pairs in ``missing``); tensor
    0's is ×1000 at spike_step, so that its RMS_t rises above 1 and the clipping acts."""
    gen = torch.Generator().manual_seed(21)
    out = []
    for t in range(steps):
        gs = [torch.randn(s, generator=gen) * (1000.0 if (t, i) == (spike_step, 0) else 1.0)
              for i, s in enumerate(FUSED_SHAPES)]
        out.append([None if (t, i) in missing else g.to(device) for i, g in enumerate(gs)])
    return out


def run_path(device, grads, fused, *, groups=None, skips=None, **options):
    """Parameters and optimizer after ``grads``; ``groups(params)`` makes the param groups,
    ``skips[t]`` (a set of tensor indices) is the step's skip mask."""
    gen = torch.Generator().manual_seed(20)
    params = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in FUSED_SHAPES]
    opt = StableAdamW(groups(params) if groups else params, fused=fused, **options)
    for t, gs in enumerate(grads):
        for p, g in zip(params, gs, strict=True):
            p.grad = None if g is None else g.clone()
        skip = None
        if skips is not None and skips[t]:
            skip = {p: torch.tensor(i in skips[t], device=device)
                    for i, p in enumerate(params) if p.grad is not None}
            for p, flag in skip.items():
                p.grad.masked_fill_(flag, 0)  # as PerTensorScaler does
        opt.step(skip=skip)
    return params, opt


def assert_paths_agree(fused_run, foreach_run, ulps=8.0):
    (params, opt), (ref_params, ref_opt) = fused_run, foreach_run
    for p, r in zip(params, ref_params, strict=True):
        assert_close_to_rounding(p, r, ulps)
        assert opt.state[p].keys() == ref_opt.state[r].keys()
        for key in opt.state[p]:
            assert opt.state[p][key].dtype == ref_opt.state[r][key].dtype
            assert_close_to_rounding(opt.state[p][key], ref_opt.state[r][key], ulps)


FUSED_CASES = {
    "decay-rms-groups": dict(
        groups=lambda ps: [dict(params=ps[:2]),
                           dict(params=ps[2:], lr=5e-3, betas=(0.8, 0.95), weight_decay=0.3)],
        lr=1e-2, weight_decay=0.1, track_rms=True),
    "clip-decay-maximize-tensor-lr": dict(
        lr=torch.tensor(2e-2), weight_decay=0.2, clip_weight_decay=True, maximize=True,
        track_rms=True),
    "no-decay-threshold-eps": dict(lr=1e-2, weight_decay=0.0, clip_threshold=1.5, eps=1e-3),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_matches_foreach(case, device, requires_triton):
    """Over 10 steps with an RMS spike and missing gradients, the fused step gives the foreach
    step's parameters and state to float32 rounding."""
    options = dict(FUSED_CASES[case])
    if isinstance(options["lr"], torch.Tensor):
        options["lr"] = options["lr"].to(device)
    grads = fused_gradients(device, 10, spike_step=9, missing={(2, 1), (3, 1), (5, 3)})
    fused = run_path(device, grads, True, **options)
    foreach = run_path(device, grads, False, **options)
    assert_paths_agree(fused, foreach)
    if options.get("track_rms"):
        assert fused[1].state[fused[0][0]]["rms"].item() > 1.2  # the last step was clipped
        assert fused[1].state[fused[0][1]]["step"].item() == 8  # two steps without a gradient


def test_fused_skip_masks(device, requires_triton):
    """Skipped tensors (the loss scaler's flags), from the first step on: parameter and state
    stay bit for bit; the others match the foreach path."""
    grads = fused_gradients(device, 5, spike_step=3)
    skips = [{0}, set(), {1, 3}, {0}, set()]
    options = dict(lr=1e-2, weight_decay=0.1, track_rms=True, skips=skips)
    fused = run_path(device, grads, True, **options)
    assert_paths_agree(fused, run_path(device, grads, False, **options))
    # skipped steps are not counted (tensor 0: twice, the first time before any step)
    params, opt = fused
    assert opt.state[params[0]]["step"].item() == 3
    assert opt.state[params[1]]["step"].item() == 4
    before = {k: v.clone() for k, v in opt.state[params[1]].items()}
    p1 = params[1].detach().clone()
    params[1].grad = torch.zeros_like(params[1])
    opt.step(skip={params[1]: torch.tensor(True, device=device)})
    assert torch.equal(params[1], p1)
    for key, value in before.items():
        assert torch.equal(opt.state[params[1]][key], value)


def test_fused_with_per_tensor_scaler(device, requires_triton):
    """PerTensorScaler on a fused optimizer: the tensor with an Inf gradient keeps its parameter
    and state; the others step as in an unscaled foreach run where it had no gradient."""
    from fusedloss.amp import PerTensorScaler

    grads = fused_gradients(device, 3, spike_step=None)
    fused_params, fused_opt = run_path(device, grads[:2], True, lr=1e-2, track_rms=True)
    ref_params, ref_opt = run_path(device, grads[:2], False, lr=1e-2, track_rms=True)
    scaler = PerTensorScaler(scale=2.0**4)
    kept = fused_params[2].detach().clone()
    state = {k: v.clone() for k, v in fused_opt.state[fused_params[2]].items()}
    for i, (p, r, g) in enumerate(zip(fused_params, ref_params, grads[2], strict=True)):
        empty = p.numel() == 0  # the scaler's max-norm has no value for an empty gradient
        p.grad = None if empty else g * 2.0**4
        r.grad = None if i == 2 or empty else g.clone()
    fused_params[2].grad[0, 0, 0] = float("inf")
    scaler.step(fused_opt)
    ref_opt.step()
    assert torch.equal(fused_params[2], kept)
    for key, value in state.items():
        assert torch.equal(fused_opt.state[fused_params[2]][key], value)
    for i, (p, r) in enumerate(zip(fused_params, ref_params, strict=True)):
        assert_close_to_rounding(p, r)
        if i != 2:
            for key in STATE_KEYS:
                assert_close_to_rounding(fused_opt.state[p][key], ref_opt.state[r][key])


@pytest.mark.parametrize("direction", ["fused-to-foreach", "foreach-to-fused"])
def test_state_dict_round_trip_between_paths(direction, device, requires_triton):
    """A state saved by one path, loaded into the other, continues like the first path."""
    first, second = (True, False) if direction == "fused-to-foreach" else (False, True)
    grads = fused_gradients(device, 6, spike_step=4)
    options = dict(lr=1e-2, weight_decay=0.1, track_rms=True)
    params, opt = run_path(device, grads[:3], first, **options)
    clones = [p.detach().clone().requires_grad_() for p in params]
    opt2 = StableAdamW(clones, fused=second, lr=0.5)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(params, clones, strict=True):
        for key in STATE_KEYS:
            assert torch.equal(opt.state[p][key], opt2.state[q][key])
    assert opt2.fused is second and opt2.param_groups[0]["lr"] == 1e-2
    for gs in grads[3:]:
        for p, q, g in zip(params, clones, gs, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    for p, q in zip(params, clones, strict=True):
        assert_close_to_rounding(q, p)
        for key in STATE_KEYS:
            assert_close_to_rounding(opt2.state[q][key], opt.state[p][key])


def test_fused_schedule_lag_does_not_change_results(monkeypatch, device, requires_triton):
    """The order of the work items (how far each tensor's second pass trails its first) leaves
    every result bit for bit as it was: each tensor's partial sums are added in a fixed order."""
    from fusedloss import _optim_kernels

    grads = fused_gradients(device, 3, spike_step=1)
    results = []
    for lag in (0, 3, 1000):
        cfg = dataclasses.replace(_optim_kernels.fused_config(torch.device(device)), lag=lag)
        monkeypatch.setattr(_optim_kernels, "fused_config", lambda _, cfg=cfg: cfg)
        results.append(run_path(device, grads, True, lr=1e-2, track_rms=True))
    (params, opt), *others = results
    for other_params, other_opt in others:
        for p, q in zip(params, other_params, strict=True):
            assert torch.equal(p, q)
            for key in STATE_KEYS:
                assert torch.equal(opt.state[p][key], other_opt.state[q][key])


def test_fused_layouts(device, requires_triton):
    """A dense permuted parameter with a like-strided gradient runs fused; a gradient laid out
    unlike its parameter takes the foreach path; both as the foreach path computes."""
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(3, 4, 5, generator=gen).permute(2, 0, 1), torch.randn(6, 5, generator=gen)]
    grads = [[torch.randn(b.shape, generator=gen) for b in base] for _ in range(3)]

    def run(fused):
        params = [b.clone().to(device).requires_grad_() for b in base]  # clone keeps strides
        opt = StableAdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)
        for gs in grads:
            params[0].grad = torch.empty_like(params[0]).copy_(gs[0].to(device))
            params[1].grad = gs[1].to(device).t().contiguous().t()  # column-major gradient
            opt.step()
        return params, opt

    assert run(True)[0][0].stride() == base[0].stride()
    assert_paths_agree(run(True), run(False))


@given(chunks=st.lists(st.integers(1, 6), min_size=1, max_size=8), lag=st.integers(0, 12))
def test_work_schedule_orders_passes(chunks, lag):
    """Every chunk once per pass, and a tensor's pass-2 items only after all its pass-1 items:
    the order that lets a pass-2 program wait for its tensor's pass 1 without deadlock."""
    from fusedloss._optim_kernels import work_schedule

    items = work_schedule(chunks, lag)
    total = sum(chunks)
    assert sorted(items) == list(range(2 * total))
    owner = [k for k, n in enumerate(chunks) for _ in range(n)]
    done = [0] * len(chunks)
    for item in items:
        k = owner[item >> 1]
        if item & 1 == 0:
            done[k] += 1
        else:
            assert done[k] == chunks[k]


def test_fused_true_needs_a_device_the_kernels_run_on(monkeypatch):
    """fused=True on the CPU without the interpreter, or with other dtypes, is refused; the
    default then takes the foreach path."""
    monkeypatch.setattr(config, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="fused=True"):
        StableAdamW([torch.zeros(3, requires_grad=True)], fused=True)
    monkeypatch.setattr(config, "interpreting", lambda: True)
    for dtype in (torch.float64, torch.bfloat16):
        with pytest.raises(RuntimeError, match="fused=True"):
            StableAdamW([torch.zeros(3, dtype=dtype, requires_grad=True)], fused=True)
    opt = StableAdamW([torch.zeros(3, requires_grad=True)], fused=True)
    with pytest.raises(RuntimeError, match="fused=True"):
        opt.add_param_group(dict(params=[torch.zeros(2, dtype=torch.float64)]))
    assert len(opt.param_groups) == 1
    monkeypatch.setattr(config, "interpreting", lambda: False)
    p = torch.zeros(3, requires_grad=True)
    opt = StableAdamW([p], lr=0.1)  # fused=None: foreach on the CPU
    p.grad = torch.ones(3)
    opt.step()
    assert torch.all(p < 0)


def test_fused_step_never_reads_a_tensor_on_the_host(device, requires_triton):
    """Fused steps with a tensor lr, clipped decay, RMS tracking, new gradient tensors at every
    step (the address table is rebuilt), a gradient spike and a skip mask read nothing back to
    the host, and give the foreach path's parameters and state."""
    grads = fused_gradients(device, 4, spike_step=2)
    options = dict(lr=torch.tensor(1e-2, device=device), weight_decay=0.1,
                   clip_weight_decay=True, track_rms=True, skips=[set(), set(), set(), {0}])
    with host_reads_forbidden():
        fused = run_path(device, grads, True, **options)
    assert_paths_agree(fused, run_path(device, grads, False, **options))
    params, opt = fused
    assert opt.state[params[0]]["step"].item() == 3  # the skipped step is not counted
    assert opt.state[params[1]]["step"].item() == 4


@requires_cuda
def test_fused_queues_without_waiting_on_cuda():
    """On CUDA, ``set_sync_debug_mode("error")`` raises on any wait for the device: none while
    the step rebuilds its address table (new gradients), takes skip flags or a tensor lr."""
    params = [torch.randn(s, device="cuda").requires_grad_() for s in [(300, 1001), (7,), (1,)]]
    opt = StableAdamW(params, lr=torch.tensor(1e-3, device="cuda"), weight_decay=0.1,
                      track_rms=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # compiles the kernel, creates the state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        opt.step(skip={params[0]: torch.ones((), dtype=torch.bool, device="cuda")})
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(torch.stack([opt.state[p]["rms"] for p in params])).all()


@requires_cuda
def test_fused_matches_foreach_on_cuda_at_gpu_sizes():
    """GPU chunks: tensors of many chunks (more partials than one reduction block) and sizes
    that are not multiples of a chunk; fused=None (the default) is the fused path on CUDA."""
    shapes = [(4099,), (1, 1), (300, 1001), (2**21 + 5,), (768,)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    grads = [[torch.randn(s, device="cuda", generator=gen) * (300.0 if (t, i) == (4, 3) else 1.0)
              for i, s in enumerate(shapes)] for t in range(5)]

    def run(fused):
        params = [torch.ones(s, device="cuda").requires_grad_() for s in shapes]
        opt = StableAdamW(params, lr=1e-2, weight_decay=0.1, track_rms=True, fused=fused)
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        return params, opt

    fused, default, foreach = run(True), run(None), run(False)
    assert_paths_agree(fused, foreach, ulps=16.0)
    for p, q in zip(fused[0], default[0], strict=True):
        assert torch.equal(p, q)  # the default is the fused path on CUDA
    assert fused[1].state[fused[0][3]]["rms"].item() > 1.2


@requires_cuda
@pytest.mark.parametrize("fused", [None, False])
def test_step_replays_in_a_cuda_graph(fused):
    """A step captured in a CUDA graph and replayed equals eager steps (nothing read on the
    host, the fused kernel's counters ready again for every replay)."""
    shapes = [(300, 1001), (7,), (2**20 + 3,)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    grads = [[torch.randn(s, device="cuda", generator=gen) for s in shapes] for _ in range(6)]

    def make():
        params = [torch.ones(s, device="cuda").requires_grad_() for s in shapes]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = StableAdamW(params, lr=torch.tensor(1e-2, device="cuda"), weight_decay=0.1,
                          fused=fused)
        return params, opt

    eager, eager_opt = make()
    for gs in grads:
        for p, g in zip(eager, gs, strict=True):
            p.grad.copy_(g)
        eager_opt.step()

    params, opt = make()
    for p, g in zip(params, grads[0], strict=True):
        p.grad.copy_(g)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        opt.step()  # warm-up outside the graph: state, tables and kernels exist
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for gs in grads[1:]:
        for p, g in zip(params, gs, strict=True):
            p.grad.copy_(g)
        graph.replay()
    torch.cuda.synchronize()
    for p, q in zip(eager, params, strict=True):
        assert torch.equal(p, q)


def test_fused_config_override(tune):
    """``Tuning.optim_config`` (``FUSEDLOSS_OPTIM_CONFIG``) sets the fused step's launch shape
    on CUDA (for tuning), and a malformed value is an error naming the variable."""
    from fusedloss import _optim_kernels

    cuda = torch.device("cuda", 0)
    tune(optim_config="8192,4,528")
    cfg = _optim_kernels.fused_config(cuda)
    assert (cfg.block, cfg.num_warps, cfg.lag, cfg.reduce_block) == (8192, 4, 528, 512)
    assert cfg.step == 8192  # without a sub-block, the whole block at once
    tune(optim_config="32768,16,264,4096")
    cfg = _optim_kernels.fused_config(cuda)
    assert (cfg.block, cfg.num_warps, cfg.lag, cfg.step) == (32768, 16, 264, 4096)
    assert _optim_kernels.fused_config(torch.device("cpu")) == _optim_kernels.INTERPRETER_CONFIG
    for bad in ("4096,8", "4096,8,x", "3000,8,10", "4096,3,10", "4096,8,-1", "4096,8,10,8192",
                "4096,8,10,1000", "4096,8,10,256", "4096,8,10,512,1"):
        tune(optim_config=bad)
        with pytest.raises(ValueError, match="FUSEDLOSS_OPTIM_CONFIG"):
            _optim_kernels.fused_config(cuda)
