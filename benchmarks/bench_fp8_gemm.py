"""The block-FP8 linear kernel against torch at the Qwen3-8B linear shapes, on one CUDA GPU (8.9+).

    python benchmarks/bench_fp8_gemm.py

For each layer (qkv, o, gate_up, down) and token count: the Triton kernels (``fp8_linear_triton``:
activation quantization per 1x128 group included, block scales applied per k-block; also with
``PRECISE`` off, the tensor cores' own FP8 accumulation inside each k-block), ``torch._scaled_mm``
on e4m3 inputs already quantized with one scale per tensor (cuBLAS; the tensor-core rate with the
least scaling work, no activation quantization timed), and the bf16 ``F.linear``. Times are medians
of ``triton.testing.do_bench``; TFLOP/s count 2·M·N·K. First the kernel is checked against the
torch path of ``fp8.py`` (CPU, float32) at every shape with M = 16.
"""
import torch
import torch.nn.functional as F
import triton

from nanovllm.layers.quantization.fp8 import FP8_DTYPE, fp8_linear, quantize_weight_blocks
from nanovllm.layers.quantization import fp8_triton
from nanovllm.layers.quantization.fp8_triton import fp8_linear_triton

HIDDEN, INTER, Q_HEADS, KV_HEADS, HEAD_DIM = 4096, 12288, 32, 8, 128
LAYERS = {"qkv": ((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, Q_HEADS * HEAD_DIM),
          "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
TOKENS = (1, 16, 64, 256, 2048, 8192)


def scaled_mm_time(x: torch.Tensor, w: torch.Tensor) -> float | None:
    m = x.shape[0]
    if m % 16:
        return None
    one = torch.ones((), device=x.device)
    a, b = x.to(FP8_DTYPE), w.t()  # b column-major, as cuBLAS wants it
    return triton.testing.do_bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))


def main() -> None:
    torch.manual_seed(0)
    weights = {}
    for name, (n, k) in LAYERS.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        wq, ws = quantize_weight_blocks(w)
        weights[name] = (w.bfloat16(), wq, ws)
        x = torch.randn(16, k, device="cuda")
        ref = fp8_linear(x.cpu(), wq.cpu(), ws.cpu())
        for precise in (True, False):
            fp8_triton.PRECISE = precise
            got = fp8_linear_triton(x, wq, ws).cpu()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            print(f"check {name} (float32, precise={precise}): [16, {k}] x [{n}, {k}]^T, "
                  f"max |kernel - torch path| / max |out| = {err:.1e}")
    print(f"\n{'layer':8s} {'M':>6s} | {'fp8 triton us':>13s} {'TFLOP/s':>8s} | {'imprecise us':>13s} {'TFLOP/s':>8s} "
          f"| {'_scaled_mm us':>13s} {'TFLOP/s':>8s} "
          f"| {'bf16 us':>8s} {'TFLOP/s':>8s}")
    for name, (n, k) in LAYERS.items():
        w, wq, ws = weights[name]
        for m in TOKENS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            flops = 2 * m * n * k
            fp8_triton.PRECISE = False
            t_fast = triton.testing.do_bench(lambda: fp8_linear_triton(x, wq, ws))
            fp8_triton.PRECISE = True
            t_fp8 = triton.testing.do_bench(lambda: fp8_linear_triton(x, wq, ws))
            t_mm = scaled_mm_time(x, wq)
            t_bf16 = triton.testing.do_bench(lambda: F.linear(x, w))
            mm = f"{t_mm * 1e3:13.1f} {flops / t_mm / 1e9:8.1f}" if t_mm else f"{'-':>13s} {'-':>8s}"
            print(f"{name:8s} {m:6d} | {t_fp8 * 1e3:13.1f} {flops / t_fp8 / 1e9:8.1f} "
                  f"| {t_fast * 1e3:13.1f} {flops / t_fast / 1e9:8.1f} | {mm} "
                  f"| {t_bf16 * 1e3:8.1f} {flops / t_bf16 / 1e9:8.1f}")


if __name__ == "__main__":
    main()
