"""What gradient filtering's bookkeeping costs the LM head where it skips nothing.

    python -m benchmarks.filter_cost [--rounds 6] [--eps auto|<float>]

Forward+backward of ``fusedloss.linear_cross_entropy`` on peaked bf16 inputs (N = 8192) with
the filter (``--eps``; "auto": the rule's bound for bf16) against ``filter_eps=None``, in
alternating rounds of ``do_bench`` medians; writes filter_cost_<date>_<gpu>[_<tag>].json.
Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import triton

from benchmarks import common
from benchmarks.inputs import make_lm_head_inputs

SHAPES = {"trained-size": (32768, 768), "phi3.5": (32064, 3072), "gemma2-2b": (256000, 2304)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.filter_cost")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--eps", default="auto",
                        help='the filter: a float, or "auto" for the rule\'s bound for bf16')
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    import fusedloss
    from fusedloss.core.filtering import resolve_filter_eps

    eps = resolve_filter_eps("auto" if args.eps == "auto" else float(args.eps), torch.bfloat16)
    results = {}
    for name, (v, d) in SHAPES.items():
        e, c, y = make_lm_head_inputs(args.n, v, d, "peaked", device="cuda")
        e.requires_grad_()
        c.requires_grad_()

        def step(filter_eps, e=e, c=c, y=y):
            loss = fusedloss.linear_cross_entropy(e, c, y, filter_eps=filter_eps)
            torch.autograd.grad(loss, (e, c))

        rounds: dict[str, list[float]] = {"filtered": [], "exact": []}
        for _ in range(args.rounds):
            for key, value in (("filtered", eps), ("exact", None)):
                rounds[key].append(triton.testing.do_bench(
                    lambda value=value: step(value), warmup=25, rep=150, return_mode="median"))
        ratios = [f / x for f, x in zip(rounds["filtered"], rounds["exact"], strict=True)]
        results[name] = {"V": v, "D": d, **rounds, "ratios": ratios}
        print(f"{name} ({v}×{d}): filtered {statistics.median(rounds['filtered']):.3f} ms, "
              f"exact {statistics.median(rounds['exact']):.3f} ms, per-round ratio median "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})",
              flush=True)
    env = common.collect_environment(torch.device("cuda"))
    stem = common.results_stem("filter_cost", env["date"], env["device_slug"], args.tag)
    path = common.write_json(args.out, stem, {
        "environment": env, "n": args.n, "filter_eps": eps, "results": results})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
