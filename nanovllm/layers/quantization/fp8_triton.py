"""W8A8 block-FP8 linear as two Triton kernels, for GPUs of compute capability 8.9+: the arithmetic
of ``fp8.py``'s torch path.

``_quantize_kernel``: one program per token and 128-channel group quantizes the activations as
``quantize_activation_groups`` does (scale = max |x| / 448 by a rounded division, 1 for an all-zero
group; x / scale clamped and rounded to the nearest e4m3). ``_fp8_gemm_kernel``: a program owns a
[BLOCK_M tokens, BLOCK_N outputs] tile and walks K in 128-wide blocks; for each it multiplies the
tokens' e4m3 values by the weight's e4m3 block on the tensor cores and adds the float32 result times
(activation scale x weight scale) to the float32 tile, k-blocks in order. The products of e4m3 values
are exact in float32; only the order of the sums inside a k-block differs from the torch path (a few
float32 ulps). Quantizing inside the GEMM's k-loop instead would redo it for every BLOCK_N outputs.

``PRECISE``: Hopper's FP8 MMA keeps fewer bits than float32 while it accumulates; with PRECISE each
MMA's result is added in float32 (``max_num_imprecise_acc=0``), which halves the large-batch rate
(BENCHMARKS.md) but keeps the torch path's numbers.
"""
import torch
import triton
import triton.language as tl

from nanovllm.layers.quantization.fp8 import BLOCK, FP8_DTYPE, FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)
_BLOCK_K = tl.constexpr(BLOCK)
PRECISE = True  # see _fp8_gemm_kernel


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, stride_sm):
    """One (token, 128-channel group): its e4m3 values and scale, as ``quantize_activation_groups``."""
    row, group = tl.program_id(0), tl.program_id(1)
    k = group * _BLOCK_K + tl.arange(0, _BLOCK_K)
    x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=0), _FP8_MAX)
    scale = tl.where(scale == 0.0, 1.0, scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX), _FP8_MAX)
    tl.store(q_ptr + row * stride_qm + k, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=k < K)
    tl.store(scale_ptr + row * stride_sm + group, scale)


@triton.jit
def _fp8_gemm_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_qm, stride_xsm, stride_wn,
                     stride_wsn, stride_om, HAS_BIAS: tl.constexpr, PRECISE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, _BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, _BLOCK_K)):
        k = kb * _BLOCK_K + rk
        k_ok = k < K
        q = tl.load(q_ptr + rm[:, None] * stride_qm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if PRECISE:  # every MMA's result added in float32 (see the module docstring)
            partial = tl.dot(q, tl.trans(w), out_dtype=tl.float32, max_num_imprecise_acc=0)
        else:
            partial = tl.dot(q, tl.trans(w), out_dtype=tl.float32)
        x_scale = tl.load(xs_ptr + rm * stride_xsm + kb, mask=m_ok, other=0.0)
        w_scale = tl.load(ws_ptr + (rn // _BLOCK_K) * stride_wsn + kb, mask=n_ok, other=0.0)
        acc += partial * (x_scale[:, None] * w_scale[None, :])
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_BIAS:  # added after the cast, as the torch path does (the sum rounded once)
        bias = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + bias[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


def tile(num_tokens: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``num_tokens`` rows: small tiles for decode
    (a step reads every weight once; more programs keep more loads in flight), large for prefill.
    From a sweep on an H100 at the Qwen3-8B qkv and down shapes (BENCHMARKS.md); 17-64 rows were
    not swept."""
    if num_tokens <= 16:
        return 16, 32, 4, 6
    if num_tokens <= 64:
        return 64, 64, 4, 4
    return 64, 128, 4, 2


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``fp8.fp8_linear`` on a CUDA device: ``x`` [..., in] (float), ``weight`` [out, in]
    float8_e4m3fn, ``weight_scale`` [ceil(out/128), ceil(in/128)] float32."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m:
        groups = triton.cdiv(k, BLOCK)
        q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
        x_scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
        _quantize_kernel[(m, groups)](x2, q, x_scale, k, x2.stride(0), q.stride(0), x_scale.stride(0))
        block_m, block_n, num_warps, num_stages = tile(m)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _fp8_gemm_kernel[grid](
            q, x_scale, weight, weight_scale, bias if bias is not None else out, out, m, n, k, q.stride(0),
            x_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            PRECISE=PRECISE, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    return out.view(*lead, n)
