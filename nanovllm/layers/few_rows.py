"""RMSNorm (with its residual add) and SiLU-and-mul for a few rows on a GPU, as Triton kernels
launched as programmatic dependents: each lets the next kernel start at once, so the linear
behind it prefetches its weights into L2 while the norm runs (``rows_gemm``). The arithmetic is
``layernorm.py``'s and ``activation.py``'s, rounding for rounding."""

import torch
import triton
import triton.language as tl

from nanovllm.layers.rows_gemm import RangeSums
from nanovllm.utils.dependent_launch import launch_options, pdl, wait_for_inputs


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    eps,
    stride_x,
    stride_r,
    stride_part,
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    PARTS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row: ``sum = x + residual`` (stored), then ``w * norm(sum)``; with PARTS, x is that
    many float32 parts ``stride_part`` apart, added in order and rounded first."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, N_PAD)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    if PARTS:
        h = tl.zeros([N_PAD], tl.float32)
        for s in tl.static_range(PARTS):
            h += tl.load(x_ptr + s * stride_part + row * stride_x + cols, mask=mask, other=0.0)
        h = h.to(dtype)
    else:
        h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * N + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * N + cols, (w * (hf * rstd).to(dtype).to(tl.float32)).to(dtype), mask=mask
    )


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """BLOCK columns of one row: ``silu(gate) * up``, each rounded as torch rounds them."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (silu * up).to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor | RangeSums,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
):
    """``layernorm.rms_norm`` (``add_rms_norm`` with a residual: the pair it returns); x may be a
    split GEMM's ranges, added up here as the GEMM would have."""
    parts, dtype = 0, x.dtype
    if isinstance(x, RangeSums):  # [splits, rows, n] float32
        x, parts = x.parts, x.parts.shape[0]
    rows, n = x.shape[-2:]
    out = torch.empty(rows, n, dtype=dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        total,
        eps,
        x.stride(-2),
        residual.stride(0) if residual is not None else 0,
        x.stride(0) if parts else 0,
        N=n,
        N_PAD=triton.next_power_of_2(n),
        PARTS=parts,
        HAS_RESIDUAL=residual is not None,
        PDL=pdl(x.device),
        num_warps=4 if n <= 4096 else 8,
        **launch_options(x.device),
    )
    return out if residual is None else (out, total)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``activation.silu_and_mul``: [gate | up] -> silu(gate) * up."""
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        x,
        out,
        x.stride(0),
        n,
        BLOCK=block,
        PDL=pdl(x.device),
        num_warps=4,
        **launch_options(x.device),
    )
    return out
