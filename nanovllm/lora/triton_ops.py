"""Batched multi-LoRA over rows grouped by adapter slot. Up to ``FUSED_MAX_ROWS`` rows per slot
(decode): one fused kernel (``triton_fused``). More (prefill): two kernels, shrink
``u = x @ A[s].T`` (float32, optionally split along K into partial sums) and expand
``y += u @ B[s].T``. No host sync and no value-dependent shapes: safe inside CUDA-graph capture."""

from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.lora.triton_fused import (
    MAX_FUSED_RANK,
    _slot_rows,
    fused_blocks,
    fused_plan,
    launch_fused,
)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_SPLIT_K = 16
SPLIT_SCRATCH_ELEMENTS = 1 << 22  # split-K partial sums are not used past 16 MiB of float32
TARGET_PROGRAMS = 256  # shrink programs wanted before splitting K stops (an H100 has 132 SMs)
FUSED_MAX_ROWS = 512  # max_rows of the fused kernel: every CUDA-graph batch size of a decode


class LoraTile(NamedTuple):
    block_m: int  # rows of one slot per program
    block_n: int  # expand: output columns per program
    block_k: int  # shrink: input columns per step
    block_r: int  # rank columns per shrink program and per expand step (a power of two >= 16)
    split_k: int  # shrink: K split over this many programs, partial sums added by the expand
    fused: bool = False  # one kernel; block_n is then the expand's step, block_r the whole rank
    n_split: int = 1  # fused: output columns split over this many programs per row block
    num_warps: int = 4  # fused


@lru_cache(maxsize=4096)
def lora_tile(max_rows, num_tokens, k, n, rank, num_slots, elem_bytes: int = 2) -> LoraTile:
    """Up to ``FUSED_MAX_ROWS`` rows per slot and a padded rank <= 256: the fused kernel, its row
    block and column split from ``fused_plan`` (rows assumed spread evenly over the slots); else
    ``two_kernel_tile``."""
    if max_rows <= FUSED_MAX_ROWS and triton.next_power_of_2(rank) <= MAX_FUSED_RANK:
        rows_per_slot = max(1, min(max_rows, triton.cdiv(num_tokens, num_slots)))
        plan = fused_plan(rows_per_slot, num_slots, max_rows, k, n, rank, elem_bytes)
        _, block_m, n_split = plan
        block_n, block_k, block_r = fused_blocks(block_m, rank, elem_bytes)
        warps = 8 if block_m * block_r >= 8192 else 4
        return LoraTile(block_m, block_n, block_k, block_r, 1, True, n_split, warps)
    return two_kernel_tile(max_rows, num_tokens, k, rank, num_slots)


def two_kernel_tile(max_rows: int, num_tokens: int, k: int, rank: int, num_slots: int):
    """Shrink and expand: few rows per slot get 16-row blocks and K split until ~256 shrink
    programs run; prefill gets 64-row blocks and wider output tiles."""
    block_m = 16 if max_rows <= 64 else 32 if max_rows <= 256 else 64
    block_n = 64 if max_rows <= 256 else 128
    block_k = 64
    block_r = min(64, max(16, triton.next_power_of_2(rank)))
    programs = triton.cdiv(max_rows, block_m) * num_slots * triton.cdiv(rank, block_r)
    k_steps = triton.cdiv(k, block_k)
    split_k = min(MAX_SPLIT_K, max(1, k_steps // 2), max(1, TARGET_PROGRAMS // programs))
    split_k = max(1, min(split_k, SPLIT_SCRATCH_ELEMENTS // max(1, num_tokens * rank)))
    return LoraTile(block_m, block_n, block_k, block_r, split_k)


@triton.jit(do_not_specialize=["split_stride", "k_per_split"])
def _shrink_kernel(
    x_ptr,
    a_ptr,
    u_ptr,
    order_ptr,
    starts_ptr,
    counts_ptr,
    k,
    rank,
    stride_xt,
    stride_xk,
    stride_al,
    stride_ar,
    stride_ak,
    split_stride,
    k_per_split,
    R_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """u[split, t, r] = x[t, ks] @ a[s, r, ks] over the split's K range ks.
    grid: (cdiv(max_rows, BLOCK_M), L, split_k * R_TILES)"""
    block = tl.program_id(0)
    slot = tl.program_id(1)
    split = tl.program_id(2) // R_TILES
    r_tile = tl.program_id(2) % R_TILES
    count = tl.load(counts_ptr + slot)
    if block * BLOCK_M >= count:
        return
    tokens, row_mask = _slot_rows(slot, block, order_ptr, starts_ptr, count, BLOCK_M)
    offs_r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + (k_start + offs_k)[None, :] * stride_xk  # [M, K]
    a_ptrs = (  # the slot's A as a [K, R] tile
        a_ptr
        + slot.to(tl.int64) * stride_al
        + offs_r[None, :] * stride_ar
        + (k_start + offs_k)[:, None] * stride_ak
    )
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for kk in range(k_start, k_end, BLOCK_K):
        k_mask = offs_k < k_end - kk
        xs = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc += tl.dot(xs, a, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak

    u_ptrs = u_ptr + split.to(tl.int64) * split_stride + tokens[:, None] * rank + offs_r[None, :]
    tl.store(u_ptrs, acc, mask=row_mask[:, None] & r_mask[None, :])


@triton.jit(do_not_specialize=["split_stride"])
def _expand_kernel(
    u_ptr,
    b_ptr,
    y_ptr,
    order_ptr,
    starts_ptr,
    counts_ptr,
    n,
    rank,
    stride_bl,
    stride_bn,
    stride_br,
    stride_yt,
    stride_yn,
    split_stride,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y[t, ns] += (sum over splits of u[split, t]) @ b[s, ns].T, added in float32.
    grid: (cdiv(max_rows, BLOCK_M), cdiv(N, BLOCK_N), L)"""
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if block * BLOCK_M >= count:
        return
    tokens, row_mask = _slot_rows(slot, block, order_ptr, starts_ptr, count, BLOCK_M)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    offs_r = tl.arange(0, BLOCK_R)

    u_ptrs = u_ptr + tokens[:, None] * rank + offs_r[None, :]  # [M, R]
    b_ptrs = (  # the slot's B as an [R, N] tile
        b_ptr
        + slot.to(tl.int64) * stride_bl
        + offs_n[None, :] * stride_bn
        + offs_r[:, None] * stride_br
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):
        r_mask = offs_r < rank - r
        u_mask = row_mask[:, None] & r_mask[None, :]
        u = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for split in range(SPLIT_K):
            u += tl.load(u_ptrs + split * split_stride, mask=u_mask, other=0.0)
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(u.to(b.dtype), b, input_precision=DOT_PRECISION)
        u_ptrs += BLOCK_R
        b_ptrs += BLOCK_R * stride_br

    y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :] * stride_yn
    y_mask = row_mask[:, None] & n_mask[None, :]
    out = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32) + acc
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


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
    if not isinstance(max_rows, int) or max_rows < 0:
        raise ValueError(f"max_rows must be an int >= 0 (>= every count), got {max_rows!r}")


def add_lora(y, x, lora_a, lora_b, order, starts, counts, max_rows: int) -> None:
    """y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T for every adapter slot s and every row t in
    order[starts[s] : starts[s] + counts[s]]; other rows of y are untouched."""
    _check(y, x, lora_a, lora_b, order, starts, counts, max_rows)
    num_tokens, k = x.shape
    num_slots, rank = lora_a.shape[:2]
    tile = lora_tile(max_rows, num_tokens, k, y.shape[1], rank, num_slots, x.element_size())
    launch_lora(y, x, lora_a, lora_b, order, starts, counts, max_rows, tile)


def launch_lora(y, x, lora_a, lora_b, order, starts, counts, max_rows: int, tile) -> None:
    """``add_lora`` with a given ``LoraTile``, inputs unchecked."""
    num_tokens, k = x.shape
    num_slots, rank, _ = lora_a.shape
    n = y.shape[1]
    if max_rows == 0 or num_tokens == 0 or n == 0:
        return
    if tile.fused:
        launch_fused(y, x, lora_a, lora_b, order, starts, counts, max_rows, tile)
        return
    k_per_split = triton.cdiv(triton.cdiv(k, tile.block_k), tile.split_k) * tile.block_k
    split_k = triton.cdiv(k, k_per_split)  # no split left empty
    u = torch.empty(split_k, num_tokens, rank, dtype=torch.float32, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    row_blocks = triton.cdiv(max_rows, tile.block_m)
    r_tiles = triton.cdiv(rank, tile.block_r)
    _shrink_kernel[(row_blocks, num_slots, split_k * r_tiles)](
        x,
        lora_a,
        u,
        order,
        starts,
        counts,
        k,
        rank,
        *x.stride(),
        *lora_a.stride(),
        num_tokens * rank,
        k_per_split,
        R_TILES=r_tiles,
        DOT_PRECISION=precision,
        BLOCK_M=tile.block_m,
        BLOCK_R=tile.block_r,
        BLOCK_K=tile.block_k,
    )
    _expand_kernel[(row_blocks, triton.cdiv(n, tile.block_n), num_slots)](
        u,
        lora_b,
        y,
        order,
        starts,
        counts,
        n,
        rank,
        *lora_b.stride(),
        *y.stride(),
        num_tokens * rank,
        SPLIT_K=split_k,
        DOT_PRECISION=precision,
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
