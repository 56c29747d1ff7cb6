"""RMSNorm and SiLU-and-mul quantizing their output for the FP8 linear behind them: the plain op,
then ``quantize_activation_groups`` (one Triton kernel on a GPU)."""

import torch
import triton
import triton.language as tl
from torch import nn

from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.layernorm import RMSNorm, add_rms_norm, rms_norm
from nanovllm.parallel.distributed import all_reduce
from nanovllm.quantization.fp8 import quantize_to_rows
from nanovllm.quantization.fp8_cublas import ROW_MULTIPLE
from nanovllm.quantization.fp8_rows import empty_quantized, quantize_store
from nanovllm.quantization.fp8_types import BLOCK, QuantizedRows
from nanovllm.utils.dependent_launch import launch_options, pdl, wait_for_inputs

_BLOCK = tl.constexpr(BLOCK)


# Row counts are not specialised on (a new count would compile a new variant mid-call).
@triton.jit(do_not_specialize=["M", "M_OUT"])
def _rms_norm_quant_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    sum_ptr,
    q_ptr,
    scale_ptr,
    M,
    M_OUT,
    eps,
    stride_x,
    stride_r,
    N: tl.constexpr,
    GROUPS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row; rows from M to M_OUT (the grid) read as zeros."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)  # (row offsets past 2^31 elements in a large prefill)
    group = tl.arange(0, GROUPS)
    cols = group[:, None] * _BLOCK + tl.arange(0, _BLOCK)[None, :]  # [GROUPS, 128]
    ok = cols < tl.where(row < M, N, 0)  # a padding row reads nothing
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(
            tl.float32
        )
        x = x.to(dtype)
        tl.store(sum_ptr + row * N + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(tl.sum(xf * xf, axis=1), axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = (w * (xf * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    quantize_store(
        y, q_ptr + row * N + cols, scale_ptr + group * M_OUT + row, cols < N, group * _BLOCK < N
    )


@triton.jit(do_not_specialize=["M", "M_OUT"])
def _silu_mul_quant_kernel(
    x_ptr, q_ptr, scale_ptr, M, M_OUT, N, stride_x, BLOCK_ROWS: tl.constexpr, PDL: tl.constexpr
):
    """BLOCK_ROWS rows x one 128-channel group; rows from M to M_OUT read as zeros."""
    wait_for_inputs(PDL)
    # (offsets past 2^31)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    cols = group * _BLOCK + tl.arange(0, _BLOCK)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(
        tl.float32
    )
    up = tl.load(x_ptr + rows[:, None] * stride_x + N + cols[None, :], mask=ok, other=0.0).to(
        tl.float32
    )
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    y = (silu * up).to(dtype).to(tl.float32)
    out_rows = rows < M_OUT
    quantize_store(
        y,
        q_ptr + rows[:, None] * N + cols[None, :],
        scale_ptr + group * M_OUT + rows,
        out_rows[:, None] & (cols < N)[None, :],
        out_rows,
    )


def rms_norm_quantized(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> QuantizedRows | tuple[QuantizedRows, torch.Tensor]:
    """Quantized rows, or with ``residual`` (rows, x + residual)."""
    if x.is_cuda:
        return rms_norm_quantized_triton(x, residual, weight, eps)
    if residual is None:
        return quantize_to_rows(rms_norm(x, weight, eps))
    normed, total = add_rms_norm(x, residual, weight, eps)
    return quantize_to_rows(normed), total


def silu_and_mul_quantized(x: torch.Tensor) -> QuantizedRows:
    return silu_and_mul_quantized_triton(x) if x.is_cuda else quantize_to_rows(silu_and_mul(x))


def rms_norm_quantized_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> QuantizedRows | tuple[QuantizedRows, torch.Tensor]:
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
    m, n = x.shape
    m_out, q, scales = empty_quantized(m, n, ROW_MULTIPLE, x.device)
    total = torch.empty(m, n, dtype=x.dtype, device=x.device) if residual is not None else None
    if m_out:
        _rms_norm_quant_kernel[(m_out,)](
            x,
            residual if residual is not None else x,
            weight,
            total if total is not None else x,
            q,
            scales,
            m,
            m_out,
            eps,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            N=n,
            GROUPS=triton.next_power_of_2(scales.shape[0]),
            HAS_RESIDUAL=residual is not None,
            PDL=pdl(x.device),
            # 8 warps are faster from 4096 channels on
            num_warps=8 if n >= 4096 else 4,
            **launch_options(x.device),
        )
    rows = QuantizedRows(q, scales, m, x.dtype)
    return rows if residual is None else (rows, total)


def silu_and_mul_quantized_triton(x: torch.Tensor) -> QuantizedRows:
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, n = x.shape[0], x.shape[1] // 2
    m_out, q, scales = empty_quantized(m, n, ROW_MULTIPLE, x.device)
    if m_out:  # (a multiple of 16)
        _silu_mul_quant_kernel[(m_out // 16, scales.shape[0])](
            x,
            q,
            scales,
            m,
            m_out,
            n,
            x.stride(0),
            BLOCK_ROWS=16,
            PDL=pdl(x.device),
            **launch_options(x.device),
        )
    return QuantizedRows(q, scales, m, x.dtype)


class QuantizedRMSNorm(RMSNorm):
    """``reduces_input``: with a residual, x is a row-parallel output still to be summed."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, reduces_input: bool = False):
        super().__init__(hidden_size, eps)
        self.reduces_input = reduces_input

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None and self.reduces_input:
            all_reduce(x)
        return rms_norm_quantized(x, residual, self.weight, self.eps)


class QuantizedSiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> QuantizedRows:
        return silu_and_mul_quantized(x)
