"""Suite ``post-training``: token log-probs, GRPO, DPO and JSD through an LM head, forward +
backward, fusedloss against TRL's and liger-kernel's (definitions: benchmarks/README.md)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import common
from benchmarks.common import column
from benchmarks.inputs import LM_HEAD_SHAPES, quick_shape
from benchmarks.suites import Suite

LOSSES = ("log-probs", "grpo", "dpo", "jsd")
SHAPES = ("llama3-8b", "qwen2.5-7b")
TEMPERATURE, BETA_KL, BETA_DPO = 0.7, 0.04, 0.1


def _trl_head():
    """TRL's ``ChunkedLogProbFunction`` (TRL ≥ 1.16), or None. TRL's backward imports one helper
    from ``trl.trainer.utils``, whose imports need TRL's training dependencies: where those are
    missing, that helper is stubbed (it only gathers a ZeRO-3 head)."""
    try:
        import trl.trainer.utils  # noqa: F401
    except ImportError:
        try:
            import trl  # noqa: F401
        except ImportError:
            return None
        for name in ("trl.trainer", "trl.trainer.utils"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["trl.trainer.utils"].maybe_gather_lm_head_ctx = (
            lambda *_: contextlib.nullcontext())
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction


def _liger(name: str):
    try:
        import liger_kernel.chunked_loss as chunked
    except ImportError:
        return None
    return getattr(chunked, name)


def _inputs(shape, n: int, dtype: torch.dtype, device, seed: int) -> dict[str, Any]:
    """The policy's hidden states and head (leaves), a reference/teacher near them, targets,
    per-token upstream gradients and GRPO's advantages and old/reference log-probs."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, device=device, generator=g)

    v, d = shape.vocab_size, shape.hidden_size
    t = 1024 if n >= 2048 else max(1, n // 4)  # an even number of sequences (DPO's pairs)
    b = n // t
    h, w = randn(b, t, d), randn(v, d) / d**0.5
    x = dict(h=h.to(dtype).requires_grad_(), w=w.to(dtype).requires_grad_(),
             h_ref=(h + 0.05 * randn(b, t, d)).to(dtype), w_ref=(w + 0.005 * randn(v, d)).to(dtype),
             y=torch.randint(0, v, (b, t), device=device, generator=g),
             g=randn(b, t), adv=randn(b), mask=torch.ones(b, t, device=device))
    import fusedloss

    with torch.no_grad():
        base = fusedloss.linear_log_probs(x["h"], x["w"], x["y"], temperature=TEMPERATURE)
    x["old"], x["ref"] = base + 0.01 * randn(b, t), base + 0.01 * randn(b, t)
    return x


def _methods(loss: str, x: dict[str, Any]) -> dict[str, Callable[[], torch.Tensor]]:
    """Each method's scalar loss from ``x`` (its backward is the step's)."""
    import fusedloss
    from fusedloss import post_training

    h, w, y = x["h"], x["w"], x["y"]
    flat_h, flat_y = h.reshape(-1, h.shape[-1]), y.reshape(-1)
    g = x["g"].reshape(-1)
    methods: dict[str, Callable[[], torch.Tensor]] = {}
    if loss == "log-probs":
        def ours():
            lp, ent = fusedloss.linear_log_probs(flat_h, w, flat_y, temperature=TEMPERATURE,
                                                 return_entropy=True)
            return (lp * g).sum() + 0.01 * ent.sum()
        methods["fusedloss"] = ours
        trl_head = _trl_head()
        if trl_head is not None:
            def trl():
                lp, ent, *_ = trl_head.apply(flat_h, w, None, flat_y, TEMPERATURE, 32768, None,
                                             1.0, ("log_probs", "entropy"))
                return (lp * g).sum() + 0.01 * ent.sum()
            methods["trl"] = trl
    elif loss == "grpo":
        kw = dict(old_log_probs=x["old"], ref_log_probs=x["ref"])
        methods["fusedloss"] = lambda: post_training.grpo_loss(
            h, w, y, x["mask"], x["adv"], beta=BETA_KL, loss_type="dapo",
            temperature=TEMPERATURE, **kw)
        peer = _liger("LigerFusedLinearGRPOLoss")
        if peer is not None:
            liger = peer(beta=BETA_KL, loss_type="dapo", temperature=TEMPERATURE)
            methods["liger-kernel"] = lambda: liger(
                h, w, y, x["mask"], x["adv"], ref_per_token_logps=x["ref"],
                old_per_token_logps=x["old"])[0]
    elif loss == "dpo":
        methods["fusedloss"] = lambda: post_training.dpo_loss(
            h, w, y, ref_input=x["h_ref"], ref_weight=x["w_ref"], beta=BETA_DPO)
        peer = _liger("LigerFusedLinearDPOLoss")
        if peer is not None:
            liger = peer(beta=BETA_DPO, use_ref_model=True)
            methods["liger-kernel"] = lambda: liger(w, h, y, ref_input=x["h_ref"],
                                                    ref_weight=x["w_ref"])[0]
    else:
        teacher = (x["h_ref"].reshape(flat_h.shape), x["w_ref"])
        methods["fusedloss"] = lambda: fusedloss.linear_jsd(flat_h, w, *teacher, beta=0.5)
        peer = _liger("LigerFusedLinearJSDLoss")
        if peer is not None:
            liger = peer(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5)
            methods["liger-kernel"] = lambda: liger(flat_h, w, *teacher, flat_y)
    return methods


def measure(loss: str, x: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each method's errors against fusedloss's on fp32 copies of the operands, ms, peak MiB."""
    x32 = {k: (v.detach().float().requires_grad_(k in ("h", "w")) if v.is_floating_point()
               else v) for k, v in x.items()}
    ref = _methods(loss, x32)["fusedloss"]()
    ref_value, ref_grad = float(ref), torch.autograd.grad(ref, x32["h"])[0]
    timing = common.timing_settings(args.warmup_ms, args.rep_ms, args.quick)
    rows = []
    for method, fn in _methods(loss, x).items():
        row: dict[str, Any] = dict(loss=loss, method=method)

        def step(fn=fn):
            x["h"].grad = x["w"].grad = None
            fn().backward()
        try:
            value = fn()
            grad = torch.autograd.grad(value, x["h"])[0]
            row.update(loss_error=abs(float(value) - ref_value) / max(abs(ref_value), 1e-30),
                       grad_error=common.relative_l2_error(grad, ref_grad))
            del value, grad
            step()
            row["ms"] = common.median_ms(step, args.device, timing)
            row["mib"] = common.peak_extra_mib(step, args.device)
        except Exception as error:  # report and go on with the next method
            row["error"] = common.describe_error(error)
        x["h"].grad = x["w"].grad = None
        common.release_memory(args.device)
        rows.append(row)
        print(f"{loss:10s} {method:13s} {row.get('error') or common.format_ms(row['ms'])}",
              flush=True)
    return rows


def yardsticks(x: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """fusedloss's mean cross-entropy head, fwd + bwd, and one product (N × D)·(D × V)."""
    import fusedloss

    timing = common.timing_settings(args.warmup_ms, args.rep_ms, args.quick)
    h, w, y = x["h"].reshape(-1, x["h"].shape[-1]), x["w"], x["y"].reshape(-1)

    def ce():
        x["h"].grad = x["w"].grad = None
        fusedloss.linear_cross_entropy(h, w, y).backward()
    out = torch.empty(h.shape[0], w.shape[0], dtype=h.dtype, device=h.device)
    rows = [dict(loss="cross-entropy", method="fusedloss",
                 ms=common.median_ms(ce, args.device, timing),
                 mib=common.peak_extra_mib(ce, args.device)),
            dict(loss="product", method="cuBLAS", ms=common.median_ms(
                lambda: torch.mm(h.detach(), w.detach().T, out=out), args.device, timing))]
    x["h"].grad = x["w"].grad = None
    return rows


def run(args: argparse.Namespace) -> int:
    args.device = common.pick_device(args.device)
    env = common.collect_environment(args.device)
    dtype = common.DTYPES[args.dtype]
    rows = []
    for name in args.shapes:
        shape = LM_HEAD_SHAPES[name]
        n = args.n
        if args.quick:
            shape, n = quick_shape(shape), 256
        x = _inputs(shape, n, dtype, args.device, args.seed)
        head_rows = yardsticks(x, args)
        for loss in args.losses:
            head_rows += measure(loss, x, args)
        product = head_rows[1]["ms"]
        for row in head_rows:
            row.update(head=name, n=n, products=row["ms"] / product if "ms" in row else None)
        rows += head_rows
        del x
        common.release_memory(args.device)
    columns = [column("head", "head"), column("N", "n"), column("loss", "loss"),
               column("method", "method"), column("ms", "ms", common.format_ms),
               column("÷ one product", "products", common.format_ratio),
               column("peak MiB", "mib", common.format_mib),
               column("loss error", "loss_error", common.format_error),
               column("d input error", "grad_error", common.format_error),
               ("status", lambda r: r.get("error", "ok"))]
    tables = common.table(columns, rows)
    body = [f"{args.dtype}. Forward + backward, median ms (do_bench), peak MiB above the inputs; "
            "errors relative to fusedloss's fp32 computation of the same loss; '÷ one product' is "
            "ms over one N × D × V cuBLAS product (the losses need four: DESIGN.md §4). See "
            "benchmarks/README.md.", "", tables, ""]
    common.write_report(args.out, "post_training", args.tag, env,
                        "Post-training losses through an LM head", common.environment_rows(env, {}),
                        body, dict(environment=env, rows=rows), tables,
                        notes=[common.QUICK_NOTE] if args.quick else [])
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_list(parser, "--shapes", LM_HEAD_SHAPES, SHAPES)
    common.add_list(parser, "--losses", LOSSES, LOSSES)
    parser.add_argument("--n", type=int, default=16384, help="tokens (default 16384)")
    common.add_common_arguments(parser, "a small head and 256 tokens: a smoke test")


SUITE = Suite("post-training", "token log-probs, GRPO, DPO and JSD through an LM head against "
              "TRL's head and liger-kernel's chunked losses", add_arguments, run)
