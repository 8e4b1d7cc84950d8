"""Where the LM head's gradient-in-forward path spends its time, part by part.

    python -m benchmarks.grad_in_forward_parts [--n 65536] [--chunk 4096]

On llama3-8b's head (V = 128256, D = 4096, bf16, random inputs), times with
``triton.testing.do_bench`` each step of ``core.chunked_logits`` on one chunk and scales it to
N rows: the logits by cuBLAS with fp32 and with bf16 output, the row kernel on fp32 logits
(bf16 G over them) and on bf16 logits (in place), dA = G·B, dB accumulated in fp32 and in bf16
(liger-kernel's choice) and not accumulated; then the whole path with 2048-, 4096- and
8192-row chunks. Writes ``--out``/grad_in_forward_parts_<date>_<gpu>[_<tag>].json. Needs CUDA.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from triton.testing import do_bench

from benchmarks import common

V, D = 128256, 4096


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grad_in_forward_parts")
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    from fusedloss.core import chunked_logits as cl
    from fusedloss.core.engine import addmm_f32_

    torch.manual_seed(0)
    dev, n, r = "cuda", args.n, args.chunk
    a = (torch.randn(n, D, device=dev) * 0.5).bfloat16()
    b = (torch.randn(V, D, device=dev) / D**0.5).bfloat16()
    y = torch.randint(0, V, (n,), device=dev)
    results: dict[str, float] = {}

    def bench(name, fn, per_n=True, minus=None):
        ms = do_bench(fn, warmup=50, rep=300) * (n // r if per_n else 1)
        results[name] = ms - (results[minus] if minus else 0.0)
        print(f"{name:45s} {results[name]:8.2f} ms", flush=True)

    a_c = a[:r]
    z32 = torch.empty(r, V, device=dev)
    z16 = torch.empty(r, V, device=dev, dtype=torch.bfloat16)
    g16 = z32.view(torch.bfloat16)[:, :V]
    ones, coef = torch.ones(r, device=dev), torch.ones(1, device=dev)
    total_w, losses = torch.tensor([float(V)], device=dev), torch.zeros(r, device=dev)
    dummy = torch.empty(1, device=dev)

    def row_kernel(z, g):
        cl._softmax_grad_rows_kernel[(r,)](
            z, z.stride(0), g, g.stride(0), dummy, y[:r], ones, dummy, total_w, coef, losses, V,
            0.0, 0.0, 0.0, HAS_BIAS=False, HAS_CLASS_WEIGHT=False, SMOOTHING=False,
            SOFTCAP=False, PRECISE=False, ROUND=True, BLOCK_V=2048, num_warps=8)

    def mm32():
        torch.mm(a_c, b.T, out_dtype=torch.float32, out=z32)

    def mm16():
        torch.mm(a_c, b.T, out=z16)

    bench("logits, fp32 out", mm32)
    bench("logits, bf16 out", mm16)
    bench("row kernel, fp32 logits -> bf16 G", lambda: (mm32(), row_kernel(z32, g16)),
          minus="logits, fp32 out")
    bench("row kernel, bf16 logits in place", lambda: (mm16(), row_kernel(z16, z16)),
          minus="logits, bf16 out")
    grad_a = torch.empty(r, D, device=dev, dtype=torch.bfloat16)
    bench("dA = G B", lambda: torch.mm(g16, b, out=grad_a))
    acc32 = torch.zeros(V, D, device=dev)
    bench("dB += G^T A, fp32 accumulator", lambda: addmm_f32_(acc32, g16.T, a_c))
    acc16 = torch.zeros(V, D, device=dev, dtype=torch.bfloat16)
    bench("dB += G^T A, bf16 accumulator", lambda: torch.addmm(acc16, z16.T, a_c, out=acc16))
    bench("dB = G^T A, no accumulation", lambda: torch.mm(z16.T, a_c, out=acc16))
    valid, index, one = torch.ones(n, device=dev), torch.arange(n, device=dev), coef.reshape(())
    for chunk in (2048, 4096, 8192):
        bench(f"whole path, {chunk}-row chunks", lambda chunk=chunk: cl.loss_and_grads(
            a, b, None, index, n, y, valid, None, one, 0.0, None, 0.0, True, True, False, chunk),
            per_n=False)
    square = torch.randn(8192, 8192, device=dev).bfloat16()
    rate = 2 * 8192**3 / (do_bench(lambda: torch.mm(square, square), warmup=50, rep=300) * 1e-3)
    floor = 2 * n * V * D / rate * 1e3
    print(f"one matmul pass at the measured bf16 rate: {floor:.1f} ms")
    env = common.collect_environment(torch.device(dev))
    stem = common.results_stem("grad_in_forward_parts", env["date"], env["device_slug"], args.tag)
    path = common.write_json(args.out, stem, {
        "environment": env, "n": n, "v": V, "d": D, "chunk": r, "matmul_pass_ms": floor,
        "results_ms": results})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
