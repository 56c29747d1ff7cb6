"""Batched multi-LoRA on a GPU, folded into the base GEMM. A target layer's weight is the first N
rows of ``ext = [W; A_0; ...; A_{L-1}]``, so one cuBLAS GEMM gives ``z = x @ ext.T = [x W^T | u_0
| ... | u_{L-1}]``; one Triton kernel then writes ``out[t] = z[t, :N] + u_s[t] @ B_s^T (+ bias)``
for each row ``t`` of slot ``s`` (rows of no slot: ``z[t, :N] (+ bias)``). Rows come grouped by
slot in blocks (``blocks.block_table``, built on the host); no host sync and no value-dependent
shapes: safe inside CUDA-graph capture."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.lora.blocks import block_rows, max_blocks

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class LoraTile(NamedTuple):
    block_m: int  # rows of one slot per program
    block_n: int  # output columns per program
    block_r: int  # rank columns per step (a power of two >= 16)


def lora_tile(num_rows: int, width: int) -> LoraTile:
    block_m = block_rows(num_rows)
    return LoraTile(
        block_m, 64 if block_m == 16 else 128, min(64, max(16, 2 ** (width - 1).bit_length()))
    )


@triton.jit
def _lora_out_kernel(
    z_ptr,
    b_ptr,
    bias_ptr,
    out_ptr,
    blocks_ptr,
    order_ptr,
    num_rows,
    n,
    width,
    stride_z,
    stride_bl,
    stride_bn,
    stride_o,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    block, pid_n = tl.program_id(0), tl.program_id(1)
    if block >= tl.load(blocks_ptr):
        return
    slot = tl.load(blocks_ptr + 1 + 3 * block)
    first = tl.load(blocks_ptr + 2 + 3 * block)
    count = tl.minimum(tl.load(blocks_ptr + 3 + 3 * block), num_rows - first)
    offs_m = tl.arange(0, BLOCK_M)
    row_mask = offs_m < count
    rows = tl.load(order_ptr + first + offs_m, mask=row_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    mask = row_mask[:, None] & n_mask[None, :]
    z_rows = z_ptr + rows[:, None] * stride_z
    y = tl.load(z_rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if slot >= 0:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, width, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_mask = offs_r < width
            u_mask = row_mask[:, None] & r_mask[None, :]
            u = tl.load(z_rows + n + slot * width + offs_r[None, :], mask=u_mask, other=0.0)
            b_ptrs = b_ptr + slot * stride_bl + offs_n[:, None] * stride_bn + offs_r[None, :]
            b = tl.load(b_ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
            acc += tl.dot(u, tl.trans(b), input_precision=DOT_PRECISION)
        y += acc
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None] * stride_o + offs_n[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x, ext, lora_b, bias, blocks, order) -> None:
    if x.dim() != 2 or ext.dim() != 2 or ext.shape[1] != x.shape[1]:
        raise ValueError(
            f"x and ext must be [T, K] and [N + L*W, K], "
            f"got {tuple(x.shape)} and {tuple(ext.shape)}"
        )
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x.dtype must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    for name, t in (("ext", ext), ("lora_b", lora_b), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name}.dtype must equal x.dtype ({x.dtype}), got {t.dtype}")
    if lora_b.dim() != 3 or lora_b.shape[1] + lora_b.shape[0] * lora_b.shape[2] != ext.shape[0]:
        raise ValueError(
            f"lora_b must be [L, N, W] with N + L*W = {ext.shape[0]} (ext's rows), "
            f"got {tuple(lora_b.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (lora_b.shape[1],):
        raise ValueError(f"bias must be [N={lora_b.shape[1]}], got {tuple(bias.shape)}")
    for name, t in (("blocks", blocks), ("order", order)):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D torch.int32 tensor, got {t.dtype} {t.dim()}-D")
    if order.numel() < x.shape[0]:
        raise ValueError(f"order must have >= T = {x.shape[0]} elements, got {order.numel()}")
    need = 1 + 3 * max_blocks(x.shape[0], lora_b.shape[0], block_rows(x.shape[0]))
    if blocks.numel() < need:
        raise ValueError(
            f"blocks must have >= {need} elements for T = {x.shape[0]}, got {blocks.numel()}"
        )
    if x.stride(1) != 1 or not (ext.is_contiguous() and lora_b.is_contiguous()):
        raise ValueError("x's rows, ext and lora_b must be contiguous")


def lora_linear(x, ext, lora_b, bias, blocks, order) -> torch.Tensor:
    """``out [T, N]``: ``x @ ext[:N].T (+ bias)``, plus ``(x @ A_s.T) @ lora_b[s].T`` on the rows
    of each slot ``s`` (``A_s`` = ext's rows ``N + s*W : N + (s+1)*W``), per ``blocks``/``order``
    from ``block_table`` for T rows."""
    _check(x, ext, lora_b, bias, blocks, order)
    return launch_lora(x, ext, lora_b, bias, blocks, order)


def launch_lora(x, ext, lora_b, bias, blocks, order, tile=None) -> torch.Tensor:
    """``lora_linear`` with its inputs unchecked (the engine's call), or with a given tile."""
    num_slots, n, width = lora_b.shape
    t = x.shape[0]
    z = torch.mm(x, ext.t())
    out = z.new_empty(t, n)
    if t == 0 or n == 0:
        return out
    tile = tile or lora_tile(t, width)
    grid = (max_blocks(t, num_slots, tile.block_m), triton.cdiv(n, tile.block_n))
    _lora_out_kernel[grid](
        z,
        lora_b,
        bias if bias is not None else z,
        out,
        blocks,
        order,
        t,
        n,
        width,
        z.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        out.stride(0),
        HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_R=tile.block_r,
    )
    return out


def lora_linear_reference(x, ext, lora_b, bias, slots) -> torch.Tensor:
    """``lora_linear`` in plain torch, from each row's slot (-1: none), in the inputs' dtype."""
    num_slots, n, width = lora_b.shape
    out = x @ ext[:n].T + (0 if bias is None else bias)
    for slot in range(num_slots):
        rows = (slots == slot).nonzero().flatten()
        a = ext[n + slot * width : n + (slot + 1) * width]
        out.index_add_(0, rows, (x[rows] @ a.T) @ lora_b[slot].T)
    return out
