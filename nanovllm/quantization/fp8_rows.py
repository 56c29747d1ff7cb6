"""Activation rows quantized on the GPU, as ``quantize_activation_groups``."""

import torch
import triton
import triton.language as tl

from nanovllm.quantization.fp8_types import BLOCK, FP8_DTYPE, FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)
_BLOCK_K = tl.constexpr(BLOCK)


@triton.jit
def quantize_store(x, q_ptrs, scale_ptrs, mask, scale_mask):
    # x float32 [rows, 128]: each row's e4m3 values and scale
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), _FP8_MAX)
    scale = tl.where(scale == 0.0, 1.0, scale)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -_FP8_MAX), _FP8_MAX)
    tl.store(q_ptrs, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(scale_ptrs, scale, mask=scale_mask)


# Row counts are not specialised on: a new token count would compile a second variant mid-call.
@triton.jit(do_not_specialize=["M", "M_OUT"])
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr, M, M_OUT, K, stride_xm, stride_qm, BLOCK_ROWS: tl.constexpr
):
    # rows M..M_OUT (padding) come out as zeros with scale 1
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    k = group * _BLOCK_K + tl.arange(0, _BLOCK_K)
    k_ok = (k < K)[None, :]
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows < M)[:, None] & k_ok, other=0.0
    )
    quantize_store(
        x.to(tl.float32),
        q_ptr + rows[:, None] * stride_qm + k[None, :],
        scale_ptr + group * M_OUT + rows,
        (rows < M_OUT)[:, None] & k_ok,
        rows < M_OUT,
    )


def empty_quantized(
    m: int, k: int, row_multiple: int, device: torch.device
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(m', values [m', k], scales [k / 128, m']); m' = m rounded up."""
    m_out = triton.cdiv(m, row_multiple) * row_multiple
    q = torch.empty(m_out, k, dtype=FP8_DTYPE, device=device)
    return m_out, q, torch.empty(triton.cdiv(k, BLOCK), m_out, dtype=torch.float32, device=device)


def quantize_rows(x: torch.Tensor, row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``empty_quantized``'s tensors filled from ``x`` [m, k]."""
    m, k = x.shape
    m_out, q, scales = empty_quantized(m, k, row_multiple, x.device)
    rows = 16 if m_out >= 16 else 1
    _quantize_kernel[(triton.cdiv(m_out, rows), scales.shape[0])](
        x, q, scales, m, m_out, k, x.stride(0), q.stride(0), BLOCK_ROWS=rows
    )
    return q, scales
