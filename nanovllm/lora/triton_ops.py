"""Batched multi-LoRA on a GPU: every slot's shrink ``u = x @ A_all.T`` as one cuBLAS GEMM (the
rank is small: the slots a row does not use cost little), then one Triton kernel that adds each
row's own slot, ``y[t] += u[t, s*R : (s+1)*R] @ B[s].T``, over rows grouped by slot. No host
sync and no value-dependent shapes: safe inside CUDA-graph capture."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class LoraTile(NamedTuple):
    block_m: int  # rows of one slot per program
    block_n: int  # output columns per program
    block_r: int  # rank columns per step (a power of two >= 16)


def lora_tile(max_rows: int, rank: int) -> LoraTile:
    """Few rows per slot (decode): 16-row blocks; many (prefill): 64 rows, wider columns."""
    block_m = 16 if max_rows <= 64 else 32 if max_rows <= 256 else 64
    block_n = 64 if max_rows <= 256 else 128
    return LoraTile(block_m, block_n, min(64, max(16, triton.next_power_of_2(rank))))


@triton.jit
def _lora_expand_kernel(
    u_ptr,
    b_ptr,
    y_ptr,
    order_ptr,
    starts_ptr,
    counts_ptr,
    n,
    rank,
    stride_ut,
    stride_bl,
    stride_bn,
    stride_yt,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    block, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if block * BLOCK_M >= count:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < count
    start = tl.load(starts_ptr + slot)
    rows = tl.load(order_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        u_ptrs = u_ptr + rows[:, None] * stride_ut + slot * rank + offs_r[None, :]
        u = tl.load(u_ptrs, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        b_ptrs = b_ptr + slot * stride_bl + offs_n[:, None] * stride_bn + offs_r[None, :]
        b = tl.load(b_ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        acc += tl.dot(u, tl.trans(b), input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _check(y, x, lora_a, lora_b, order, starts, counts, max_rows) -> None:
    if y.dim() != 2 or x.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"y and x must be [T, N] and [T, K], got shapes {tuple(y.shape)} and {tuple(x.shape)}"
        )
    if y.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"y.dtype must be one of {SUPPORTED_DTYPES}, got {y.dtype}")
    for name, t in (("x", x), ("lora_a", lora_a), ("lora_b", lora_b)):
        if t.dtype != y.dtype:
            raise TypeError(f"{name}.dtype must equal y.dtype ({y.dtype}), got {t.dtype}")
    if lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1] or lora_a.shape[1] == 0:
        raise ValueError(f"lora_a must be [L, R, K={x.shape[1]}], got {tuple(lora_a.shape)}")
    num_slots, rank = lora_a.shape[0], lora_a.shape[1]
    if tuple(lora_b.shape) != (num_slots, y.shape[1], rank):
        expected = (num_slots, y.shape[1], rank)
        raise ValueError(f"lora_b must be [L, N, R] = {expected}, got {tuple(lora_b.shape)}")
    for name, t in (("order", order), ("starts", starts), ("counts", counts)):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D torch.int32 tensor, got {t.dtype} {t.dim()}-D")
    if order.numel() < y.shape[0]:
        raise ValueError(f"order must have >= T = {y.shape[0]} elements, got {order.numel()}")
    if starts.numel() != num_slots or counts.numel() != num_slots:
        raise ValueError(
            f"starts and counts must have L = {num_slots} elements, "
            f"got {starts.numel()} and {counts.numel()}"
        )
    if y.stride(1) != 1 or not (lora_a.is_contiguous() and lora_b.is_contiguous()):
        raise ValueError("y's rows, lora_a and lora_b must be contiguous")
    if not isinstance(max_rows, int) or max_rows < 0:
        raise ValueError(f"max_rows must be an int >= 0 (>= every count), got {max_rows!r}")


def add_lora(y, x, lora_a, lora_b, order, starts, counts, max_rows: int) -> None:
    """y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T for every adapter slot s and every row t in
    order[starts[s] : starts[s] + counts[s]]; other rows of y are untouched. ``max_rows`` (a
    host int >= every count) sizes the grid."""
    _check(y, x, lora_a, lora_b, order, starts, counts, max_rows)
    launch_lora(y, x, lora_a, lora_b, order, starts, counts, max_rows)


def launch_lora(y, x, lora_a, lora_b, order, starts, counts, max_rows: int, tile=None) -> None:
    """``add_lora`` with its inputs unchecked (the engine's call), or with a given tile."""
    num_slots, rank, k = lora_a.shape
    n = y.shape[1]
    if max_rows == 0 or x.shape[0] == 0 or n == 0:
        return
    u = torch.mm(x, lora_a.view(num_slots * rank, k).t())  # [T, L*R], rounded to x's dtype
    tile = tile or lora_tile(max_rows, rank)
    grid = (triton.cdiv(max_rows, tile.block_m), triton.cdiv(n, tile.block_n), num_slots)
    _lora_expand_kernel[grid](
        u,
        lora_b,
        y,
        order,
        starts,
        counts,
        n,
        rank,
        u.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_R=tile.block_r,
    )


def add_lora_reference(y, x, lora_a, lora_b, order, starts, counts) -> None:
    """``add_lora`` in plain torch (a host loop over slots, in the inputs' dtype)."""
    for slot, (start, count) in enumerate(zip(starts.tolist(), counts.tolist())):
        if count:
            rows = order[start : start + count].long()
            u = x.index_select(0, rows) @ lora_a[slot].T
            y.index_add_(0, rows, u @ lora_b[slot].T)
