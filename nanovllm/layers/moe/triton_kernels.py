"""The MoE feed-forward's grouped-GEMM Triton kernels (docs/moe.md) and ``sum_pairs``."""

import torch
import triton
import triton.language as tl


@triton.jit
def _block_rows(block, sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M: tl.constexpr):
    # a block's expert, row offsets, the pair of each row, and which rows are not padding
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    offs_r = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_r)
    return expert, offs_r, pairs, pairs < num_pairs


# Counts that change with each step's tokens are not specialised on.
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    h_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    expert_ends_ptr,
    num_pairs,
    hidden,
    inter,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wk,
    stride_hr,
    TOP_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """h[r, n] = silu(x[t] @ w13[e, n]) * (x[t] @ w13[e, inter + n]), t = sorted_pairs[r] // TOP_K;
    padding rows get zeros. grid: (max_padded_rows // BLOCK_M, cdiv(inter, BLOCK_N))"""
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    if block * BLOCK_M >= tl.load(expert_ends_ptr + NUM_EXPERTS - 1):
        return
    expert, offs_r, pairs, row_mask = _block_rows(
        block, sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M
    )
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)

    # [BLOCK_M, BLOCK_K]
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh
    # the gate rows as a [BLOCK_K, BLOCK_N] tile; the up rows sit inter rows further
    gate_ptrs = (
        w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    )
    up_ptrs = gate_ptrs + inter * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate += tl.dot(x, tl.load(gate_ptrs, mask=w_mask, other=0.0), input_precision=DOT_PRECISION)
        up += tl.dot(x, tl.load(up_ptrs, mask=w_mask, other=0.0), input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xh
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk

    h = gate * tl.sigmoid(gate) * up  # silu(gate) * up, in float32
    h_ptrs = h_ptr + offs_r.to(tl.int64)[:, None] * stride_hr + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    h_ptr,
    w2_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    expert_ends_ptr,
    num_pairs,
    hidden,
    inter,
    stride_hr,
    stride_we,
    stride_wn,
    stride_wk,
    stride_op,
    NUM_EXPERTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[p, n] = topk_weights[p] * (h[r] @ w2[e, n]), p = sorted_pairs[r]; padding rows are not
    stored. grid: (max_padded_rows // BLOCK_M, cdiv(hidden, BLOCK_N))"""
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    if block * BLOCK_M >= tl.load(expert_ends_ptr + NUM_EXPERTS - 1):
        return
    expert, offs_r, pairs, row_mask = _block_rows(
        block, sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M
    )
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)

    h_ptrs = (
        h_ptr + offs_r.to(tl.int64)[:, None] * stride_hr + offs_k[None, :]
    )  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N]
    w_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k
        h = tl.load(h_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(h, w, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    weight = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_op + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_pairs_kernel(
    pair_ptr, out_ptr, hidden, stride_p, stride_o, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(TOP_K):
        acc += tl.load(pair_ptr + (token * TOP_K + k) * stride_p + cols, mask=mask, other=0.0).to(
            tl.float32
        )
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str:
    # IEEE float32 dots for a float32 model; 16-bit inputs ignore the setting
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_gate_up(x, w13, intermediate, groups, top_k: int, num_pairs: int, tile) -> None:
    """``intermediate`` [max_padded_rows, inter] contiguous."""
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    grid = (groups.block_experts.numel(), triton.cdiv(inter, tile.block_n))
    _gate_up_kernel[grid](
        x,
        w13,
        intermediate,
        groups.sorted_pairs,
        groups.block_experts,
        groups.expert_ends,
        num_pairs,
        x.shape[1],
        inter,
        x.stride(0),
        x.stride(1),
        *w13.stride(),
        intermediate.stride(0),
        TOP_K=top_k,
        NUM_EXPERTS=num_experts,
        DOT_PRECISION=_dot_precision(x.dtype),
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def launch_down(intermediate, w2, pair_out, topk_weights, groups, num_pairs: int, tile) -> None:
    """``pair_out`` [num_pairs, hidden] contiguous; ``topk_weights`` flat."""
    num_experts, hidden, inter = w2.shape
    grid = (groups.block_experts.numel(), triton.cdiv(hidden, tile.block_n))
    _down_kernel[grid](
        intermediate,
        w2,
        pair_out,
        topk_weights,
        groups.sorted_pairs,
        groups.block_experts,
        groups.expert_ends,
        num_pairs,
        hidden,
        inter,
        intermediate.stride(0),
        *w2.stride(),
        pair_out.stride(0),
        NUM_EXPERTS=num_experts,
        DOT_PRECISION=_dot_precision(intermediate.dtype),
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def sum_pairs(pair_out: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """Each token's ``top_k`` rows of ``pair_out`` summed in float32 in k order, cast once."""
    num_pairs, hidden = pair_out.shape
    out = torch.empty(num_pairs // top_k, hidden, dtype=dtype, device=pair_out.device)
    block = min(1024, triton.next_power_of_2(hidden))
    if out.numel():
        _sum_pairs_kernel[(out.shape[0], triton.cdiv(hidden, block))](
            pair_out, out, hidden, pair_out.stride(0), out.stride(0), TOP_K=top_k, BLOCK_H=block
        )
    return out
