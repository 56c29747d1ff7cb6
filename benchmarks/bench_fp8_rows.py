"""The block-FP8 linear at decode sizes (1-16 rows) as the engine calls it, beside bf16, on one
CUDA GPU: the Qwen3-8B linear shapes.

    python benchmarks/bench_fp8_rows.py            # chosen tiles, 1-16 rows
    python benchmarks/bench_fp8_rows.py --sweep    # every tile / split / stage count at 1 row

The engine hands the FP8 linear its rows already quantized (the norm, the SiLU or the decode
attention before it), so only the GEMM is timed: ``fp8_linear_triton`` on ``QuantizedRows``. The
weights come from HBM as in a decode step (``bench_rows_gemm.graph_time``: each call reads the
next of enough weight copies to pass 256 MB, inside one CUDA graph). Beside it: cuBLAS and the
few-rows linear on the bf16 weight. Each FP8 variant is first checked against the torch path of
``fp8.py`` on the CPU. GB/s count the weight's bytes (one per FP8 value, two per bf16 value).
"""

import argparse

import torch
import torch.nn.functional as F
from bench_rows_gemm import graph_time, sweep, weights

from nanovllm.layers.rows_gemm import rows_linear
from nanovllm.quantization.fp8 import fp8_linear, quantize_weight_blocks
from nanovllm.quantization.fp8_cublas import ROW_MULTIPLE
from nanovllm.quantization.fp8_rows import quantize_rows
from nanovllm.quantization.fp8_triton import GemmTile, fp8_linear_triton
from nanovllm.quantization.fp8_types import QuantizedRows

SHAPES = {  # name: (N, K)
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b gate_up": (24576, 4096),
    "8b down": (4096, 12288),
}


def fp8_copies(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    w = torch.randn(n, k, device="cuda") * 0.02
    wq, ws = quantize_weight_blocks(w)
    copies = max(2, -(-256 * 2**20 // (n * k)))
    return [(wq.clone(), ws.clone()) for _ in range(copies)]


def quantized(x: torch.Tensor) -> QuantizedRows:
    q, scales = quantize_rows(x, ROW_MULTIPLE)  # padded to 16 rows, as the engine's producers do
    return QuantizedRows(q, scales, x.shape[0], x.dtype)


def check(rows: QuantizedRows, x: torch.Tensor, wq, ws, what: str, **kw) -> None:
    got = fp8_linear_triton(rows, wq, ws, cublas=False, **kw).float().cpu()
    want = fp8_linear(x.cpu(), wq.cpu(), ws.cpu()).float()
    err = (got - want).abs().max().item()
    if err > 2**-7 * want.abs().max().item() + 1e-3:
        raise SystemExit(f"{what}: differs from the torch path by {err}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--top", type=int, default=4, help="how many of the sweep to print")
    parser.add_argument("--rows", default="1,2,4,8,16")  # the few-rows linear takes up to 16
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| shape | rows | bf16 cuBLAS us | bf16 rows us | FP8 us | FP8 GB/s | bf16 rows GB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        fp8 = fp8_copies(n, k)
        bf16 = weights(n, k)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            rows = quantized(x)
            check(rows, x, *fp8[0], f"{name} rows {m}")
            t_cublas = graph_time(lambda i: F.linear(x, bf16[i]), len(bf16))
            t_rows = graph_time(lambda i: rows_linear(x, bf16[i]), len(bf16))
            t_fp8 = graph_time(lambda i: fp8_linear_triton(rows, *fp8[i], cublas=False), len(fp8))
            print(
                f"| {name} | {m} | {t_cublas * 1e6:.1f} | {t_rows * 1e6:.1f} | "
                f"{t_fp8 * 1e6:.1f} | {n * k / 1e9 / t_fp8:.0f} | {2 * n * k / 1e9 / t_rows:.0f} |",
                flush=True,
            )
        if args.sweep:
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            rows = quantized(x)

            def time_tile(block_n, splits, stages):
                kw = dict(gemm_tile=GemmTile(16, block_n, 4, stages), splits=splits)
                check(rows, x, *fp8[0], f"{name} {block_n}/{splits}/{stages}", **kw)
                call = lambda i: fp8_linear_triton(rows, *fp8[i], cublas=False, **kw)  # noqa: E731
                return graph_time(call, len(fp8))

            sweep(name, k, time_tile, args.top)
        fp8.clear()
        bf16.clear()


if __name__ == "__main__":
    main()
