"""Batched multi-LoRA in one Triton kernel for few rows per slot (decode): each program gathers
a block of one slot's rows, computes ``u = x @ A[s].T`` over the whole K in registers (float32,
rounded to the input dtype), then adds ``u @ B[s].T`` to its range of output columns. No host sync
and no value-dependent shapes: safe inside CUDA-graph capture."""

import triton
import triton.language as tl

MAX_FUSED_RANK = 256  # the padded rank the fused kernel holds in registers
SMS = 132  # an H100's streaming multiprocessors
L2_BYTES_PER_US = 5.5e6  # about 5.5 TB/s read from L2 by the whole GPU
SM_BYTES_PER_US = 1.1e5  # about 110 GB/s read from L2 by one SM (64 bytes a clock)
PROGRAM_US = 0.05  # cost of a program that exits at once (on one SM)


@triton.jit
def _slot_rows(slot, block, order_ptr, starts_ptr, count, BLOCK_M: tl.constexpr):
    # the rows (token indices) of one block of a slot, and which are real
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < count
    start = tl.load(starts_ptr + slot)
    tokens = tl.load(order_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    return tokens, row_mask


@triton.jit(do_not_specialize=["n_per_split"])
def _fused_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    y_ptr,
    order_ptr,
    starts_ptr,
    counts_ptr,
    k,
    n,
    rank,
    n_per_split,
    stride_xt,
    stride_xk,
    stride_al,
    stride_ar,
    stride_ak,
    stride_bl,
    stride_bn,
    stride_br,
    stride_yt,
    stride_yn,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y[t, ns] += (x[t] @ a[s].T) @ b[s, ns].T over the columns ns of split pid 1.
    grid: (cdiv(max_rows, BLOCK_M), n_split, L)"""
    block = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if block * BLOCK_M >= count:
        return
    tokens, row_mask = _slot_rows(slot, block, order_ptr, starts_ptr, count, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xk  # [M, K]
    a_ptrs = (  # the slot's A as a [K, R] tile
        a_ptr
        + slot.to(tl.int64) * stride_al
        + offs_r[None, :] * stride_ar
        + offs_k[:, None] * stride_ak
    )
    u = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for kk in range(0, k, BLOCK_K):
        k_mask = offs_k < k - kk
        xs = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        u += tl.dot(xs, a, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    u_in = u.to(x_ptr.dtype.element_ty)  # as the two-kernel path and the reference round it

    n_start = split * n_per_split
    n_end = tl.minimum(n_start + n_per_split, n)
    offs_n = tl.arange(0, BLOCK_N)
    b_ptrs = (  # the slot's B as an [R, N] tile
        b_ptr
        + slot.to(tl.int64) * stride_bl
        + (n_start + offs_n)[None, :] * stride_bn
        + offs_r[:, None] * stride_br
    )
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + (n_start + offs_n)[None, :] * stride_yn
    for nn in range(n_start, n_end, BLOCK_N):
        n_mask = offs_n < n_end - nn
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(u_in, b, input_precision=DOT_PRECISION)
        y_mask = row_mask[:, None] & n_mask[None, :]
        out = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32) + acc
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)
        b_ptrs += BLOCK_N * stride_bn
        y_ptrs += BLOCK_N * stride_yn


def fused_blocks(block_m: int, rank: int, elem_bytes: int = 2) -> tuple[int, int, int]:
    """block_n, block_k, block_r of the fused kernel: the whole rank padded to a power of two
    >= 16, A tiles of <= 16 KiB, B tiles of <= 32 KiB and output tiles of <= 8K elements."""
    block_r = max(16, triton.next_power_of_2(rank))
    block_k = min(128, max(32, 8192 * 2 // elem_bytes // block_r))
    block_n = min(256, max(32, 16384 * 2 // elem_bytes // block_r), 8192 // block_m)
    return block_n, block_k, block_r


def fused_plan(rows_per_slot, num_slots, max_rows, k, n, rank, elem_bytes: int = 2):
    """(estimated microseconds, block_m, n_split) of the cheapest fused launch in a model of L2
    reads: every program reads its rows of x and all of A[s] over K, then B[s] and y over its
    columns; the time is the busiest SM's reads or all reads over L2 bandwidth, whichever is
    longer, plus the programs that exit at once."""
    best = None
    for block_m in [m for m in (16, 32, 64) if m == 16 or m // 2 < rows_per_slot]:
        block_n, _, _ = fused_blocks(block_m, rank, elem_bytes)
        live = num_slots * triton.cdiv(rows_per_slot, block_m)
        n_tiles = triton.cdiv(n, block_n)
        for n_split in sorted({triton.cdiv(n_tiles, t) for t in range(1, n_tiles + 1)}):
            cols = triton.cdiv(n_tiles, n_split) * block_n
            rows = min(block_m, rows_per_slot)
            program = elem_bytes * ((rows + rank) * k + cols * (rank + 2 * rows))  # bytes
            programs = live * n_split
            grid = triton.cdiv(max_rows, block_m) * n_split * num_slots
            us = max(
                triton.cdiv(programs, SMS) * program / SM_BYTES_PER_US,
                programs * program / L2_BYTES_PER_US,
            )
            us += grid / SMS * PROGRAM_US
            if best is None or us < best[0]:
                best = (us, block_m, n_split)
    return best


def launch_fused(y, x, lora_a, lora_b, order, starts, counts, max_rows: int, tile) -> None:
    """The fused kernel with ``tile`` (a ``LoraTile`` with ``fused``); inputs unchecked."""
    num_slots, rank, k = lora_a.shape
    n = y.shape[1]
    n_tiles = triton.cdiv(n, tile.block_n)
    n_per_split = triton.cdiv(n_tiles, tile.n_split) * tile.block_n
    grid = (triton.cdiv(max_rows, tile.block_m), triton.cdiv(n, n_per_split), num_slots)
    _fused_kernel[grid](
        x,
        lora_a,
        lora_b,
        y,
        order,
        starts,
        counts,
        k,
        n,
        rank,
        n_per_split,
        *x.stride(),
        *lora_a.stride(),
        *lora_b.stride(),
        *y.stride(),
        DOT_PRECISION="ieee" if x.dtype.itemsize == 4 else "tf32",
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        BLOCK_R=tile.block_r,
        num_warps=tile.num_warps,
        num_stages=2 if x.element_size() == 4 else 3,  # shared memory of float32 tiles
    )
