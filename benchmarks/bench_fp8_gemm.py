"""The block-FP8 linear kernels against torch at the Qwen3-8B linear shapes, on one CUDA GPU (8.9+).

    python benchmarks/bench_fp8_gemm.py

For each layer (qkv, o, gate_up, down) and token count, GPU time under a CUDA graph
(``triton.testing.do_bench_cudagraph``, so launch overhead is not counted) of: ``fp8_linear_triton``
with its Triton GEMM (activation quantization per 1x128 group included; by default the tensor cores
sum each k-block, with ``precise`` every MMA's result is added in float32) and with cuBLAS's
block-scaled FP8 GEMM (``cublas=True``: the same quantization, rows padded to 16, then
``F.scaled_mm``; where torch and the GPU have it); ``torch._scaled_mm`` on e4m3 inputs with one
scale per tensor (the tensor-core rate with the least scaling work, no activation quantization
timed); and the bf16 ``F.linear``. TFLOP/s count 2·M·N·K. First the FP8 GEMMs are checked against
the torch path of ``fp8.py`` (CPU) at 16 and 2,048 tokens.
"""

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from nanovllm.quantization import fp8_cublas
from nanovllm.quantization.fp8 import FP8_DTYPE, fp8_linear, quantize_weight_blocks
from nanovllm.quantization.fp8_triton import fp8_linear_triton

HIDDEN, INTER, Q_HEADS, KV_HEADS, HEAD_DIM = 4096, 12288, 32, 8, 128
LAYERS = {
    "qkv": ((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, Q_HEADS * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}
TOKENS = (1, 16, 64, 96, 128, 160, 192, 256, 384, 512, 2048, 8192)


def bench(fn) -> float:
    return do_bench_cudagraph(fn, rep=20)


def main() -> None:
    torch.manual_seed(0)
    weights = {}
    for name, (n, k) in LAYERS.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        wq, ws = quantize_weight_blocks(w)
        weights[name] = (w.bfloat16(), wq, ws)
        for m in (16, 2048):
            x = torch.randn(m, k, device="cuda")
            ref = fp8_linear(x.cpu(), wq.cpu(), ws.cpu())
            errors = [
                (
                    (fp8_linear_triton(x, wq, ws, precise=p).cpu() - ref).abs().max()
                    / ref.abs().max()
                ).item()
                for p in (True, False)
            ]
            if fp8_cublas.available(x.device):
                got = fp8_linear_triton(x.bfloat16(), wq, ws, cublas=True).float().cpu()
                ref16 = fp8_linear(x.bfloat16().cpu(), wq.cpu(), ws.cpu()).float()
                errors.append(((got - ref16).abs().max() / ref16.abs().max()).item())
            print(
                f"check {name} [{m}, {k}] x [{n}, {k}]^T: max |kernel - torch path| / max |out| = "
                f"{errors[0]:.1e} precise, {errors[1]:.1e} default (float32)"
                + (f", {errors[2]:.1e} cuBLAS (bf16)" if len(errors) > 2 else "")
            )
    cols = ("fp8 triton", "precise", "fp8 cuBLAS", "_scaled_mm 1/tensor", "bf16")
    print(
        f"\n{'layer':8s} {'M':>5s} | " + " | ".join(f"{c:>19s}" for c in cols) + "   (us, TFLOP/s)"
    )
    for name, (n, k) in LAYERS.items():
        w, wq, ws = weights[name]
        for m in TOKENS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            one = torch.ones((), device="cuda")
            a, b = x.to(FP8_DTYPE), wq.t()  # b column-major, as cuBLAS wants it
            times = [
                bench(lambda: fp8_linear_triton(x, wq, ws, cublas=False)),
                bench(lambda: fp8_linear_triton(x, wq, ws, precise=True)),
                bench(lambda: fp8_linear_triton(x, wq, ws, cublas=True))
                if fp8_cublas.available(x.device)
                else None,
                bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
                if m % 16 == 0
                else None,
                bench(lambda: F.linear(x, w)),
            ]
            flops = 2 * m * n * k
            print(
                f"{name:8s} {m:5d} | "
                + " | ".join(
                    f"{t * 1e3:9.1f} {flops / t / 1e9:9.0f}" if t else f"{'-':>19s}" for t in times
                )
            )


if __name__ == "__main__":
    main()
