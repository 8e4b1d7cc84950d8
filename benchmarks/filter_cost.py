"""What gradient filtering's bookkeeping costs the LM head where it skips nothing (CUDA):
``python -m benchmarks.filter_cost [--rounds 6] [--eps auto|<float>]`` times forward+backward of
``fusedloss.linear_cross_entropy`` on peaked bf16 inputs (N = 8192) with the filter and with
``filter_eps=None``, in alternating rounds of ``do_bench`` medians; writes the results JSON."""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks import common
from benchmarks.inputs import make_lm_head_inputs

SHAPES = {"trained-size": (32768, 768), "phi3.5": (32064, 3072), "gemma2-2b": (256000, 2304)}
N = 8192
TIMING = common.TimingSettings(warmup_ms=25, rep_ms=150)


def time_rounds(vocab: int, width: int, eps: float, rounds: int) -> dict[str, list[float]]:
    """Median ms of forward+backward, filtered and exact, in alternating rounds."""
    import fusedloss

    e, c, y = make_lm_head_inputs(N, vocab, width, "peaked", device="cuda")
    e.requires_grad_()
    c.requires_grad_()

    def step(filter_eps: float | None) -> None:
        torch.autograd.grad(fusedloss.linear_cross_entropy(e, c, y, filter_eps=filter_eps), (e, c))

    times: dict[str, list[float]] = {"filtered": [], "exact": []}
    for _ in range(rounds):
        for key, filter_eps in (("filtered", eps), ("exact", None)):
            times[key].append(common.median_ms(lambda f=filter_eps: step(f), "cuda", TIMING))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.filter_cost")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--eps", default="auto", help='a float, or "auto" (the bound for bf16)')
    args = parser.parse_args(argv)
    from fusedloss.core.filtering import resolve_filter_eps

    eps = resolve_filter_eps("auto" if args.eps == "auto" else float(args.eps), torch.bfloat16)
    results = {}
    for name, (v, d) in SHAPES.items():
        times = time_rounds(v, d, eps, args.rounds)
        ratios = [f / x for f, x in zip(times["filtered"], times["exact"], strict=True)]
        results[name] = {"V": v, "D": d, **times, "ratios": ratios}
        print(f"{name} ({v}×{d}): filtered {statistics.median(times['filtered']):.3f} ms, "
              f"exact {statistics.median(times['exact']):.3f} ms, per-round ratio median "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})", flush=True)
    env = common.collect_environment("cuda")
    stem = common.results_stem("filter_cost", env["date"], env["device_slug"])
    payload = {"environment": env, "n": N, "filter_eps": eps, "results": results}
    print(f"results: {common.write_json(common.RESULTS_DIR, stem, payload)}")


if __name__ == "__main__":
    main()
