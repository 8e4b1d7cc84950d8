"""Launch-shape sweep of StableAdamW's fused step (``core.config.Tuning.optim_config``).

    python -m benchmarks.optim_sweep --configs 32768,16,264,4096 16384,8,264,4096 ...

Times one fused StableAdamW step per configuration "block,num_warps,lag[,sub_block]" over the
companions suite's ViT-B/16 tower parameters (``do_bench`` medians, warm-up 25 ms, rep 200 ms),
the default launch shape last and fused AdamW before and after; writes
``--out``/optim_sweep_<date>_<gpu>[_<tag>].json. Needs CUDA.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton

from benchmarks import common, vit
from benchmarks.suites.companions import HYPER, tower_parameters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.optim_sweep")
    parser.add_argument("--configs", nargs="+", required=True,
                        help='launch shapes "block,num_warps,lag[,sub_block]"')
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    from fusedloss.core import config
    from fusedloss.optim import StableAdamW

    device = torch.device("cuda")
    params = tower_parameters(vit.VIT_B_16, 0, device)

    def bench(step) -> float:
        step()  # the state, and the kernel's compilation
        return triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")

    def adamw_ms() -> float:
        return bench(torch.optim.AdamW(params, **HYPER, fused=True).step)

    before = adamw_ms()
    rows = []
    for spec in args.configs:
        with config.tuned(optim_config=spec):
            ms = bench(StableAdamW(params, **HYPER).step)
        rows.append({"config": spec, "ms": ms, "vs_fused_adamw": ms / before})
        print(f"{spec:22s} {ms:.3f} ms  {ms / before:.2f}× fused AdamW", flush=True)
        torch.cuda.empty_cache()
    default = bench(StableAdamW(params, **HYPER).step)
    after = adamw_ms()
    print(f"default {default:.3f} ms; fused AdamW {before:.3f} / {after:.3f} ms")
    for row in sorted(rows, key=lambda r: r["ms"])[:5]:
        print(f"  {row['config']}: {row['ms']:.3f} ms = {row['vs_fused_adamw']:.2f}×")
    env = common.collect_environment(device)
    stem = common.results_stem("optim_sweep", env["date"], env["device_slug"], args.tag)
    path = common.write_json(args.out, stem, {
        "environment": env, "parameters": sum(p.numel() for p in params), "hyper": HYPER,
        "adamw_fused_ms": [before, after], "default_ms": default, "rows": rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
