"""The MoE grouped-GEMM Triton kernels with FP8 expert weights: ``triton_kernels.py``'s layout
with ``fp8_triton.py``'s W8A8 arithmetic (docs/moe.md)."""

import triton
import triton.language as tl

from nanovllm.layers.moe.triton_kernels import _block_rows
from nanovllm.quantization.fp8_types import BLOCK

_BLOCK_K = tl.constexpr(BLOCK)


@triton.jit
def _scaled_block(acc, q, w_rows, k, k_ok, n_ok, scale, PRECISE: tl.constexpr):
    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    if PRECISE:
        partial = tl.dot(q, tl.trans(w), out_dtype=tl.float32, max_num_imprecise_acc=0)
    else:
        partial = tl.dot(q, tl.trans(w), out_dtype=tl.float32)
    return acc + partial * scale[:, None]


# Counts that change with each step's tokens are not specialised on.
@triton.jit(do_not_specialize=["num_pairs", "num_tokens"])
def _gate_up_fp8_kernel(
    q_ptr,
    xs_ptr,
    w13_ptr,
    ws13_ptr,
    h_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    expert_ends_ptr,
    num_pairs,
    num_tokens,
    hidden,
    inter,
    stride_qt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_hr,
    TOP_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """As ``_gate_up_kernel`` on e4m3 rows ``q`` with scales ``xs``."""
    block, n_tile = tl.program_id(0), tl.program_id(1)
    if block * BLOCK_M >= tl.load(expert_ends_ptr + NUM_EXPERTS - 1):
        return
    expert, offs_r, pairs, row_ok = _block_rows(
        block, sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M
    )
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    rk = tl.arange(0, _BLOCK_K)
    gate_rows = w13_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + inter * stride_wn
    gate_scales = ws13_ptr + expert * stride_se + (n_tile * BLOCK_N // _BLOCK_K) * stride_sn
    up_scales = gate_scales + (inter // _BLOCK_K) * stride_sn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(hidden, _BLOCK_K)):
        k = kb * _BLOCK_K + rk
        k_ok = k < hidden
        q = tl.load(
            q_ptr + tokens[:, None] * stride_qt + k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        x_scale = tl.load(xs_ptr + kb * num_tokens + tokens, mask=row_ok, other=0.0)
        gate = _scaled_block(
            gate, q, gate_rows, k, k_ok, n_ok, x_scale * tl.load(gate_scales + kb), PRECISE
        )
        up = _scaled_block(
            up, q, up_rows, k, k_ok, n_ok, x_scale * tl.load(up_scales + kb), PRECISE
        )
    h = gate * tl.sigmoid(gate) * up  # silu(gate) * up, in float32
    h_ptrs = h_ptr + offs_r.to(tl.int64)[:, None] * stride_hr + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_rows"])
def _down_fp8_kernel(
    qh_ptr,
    hs_ptr,
    w2_ptr,
    ws2_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    expert_ends_ptr,
    num_pairs,
    num_rows,
    hidden,
    inter,
    stride_qr,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_op,
    NUM_EXPERTS: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """As ``_down_kernel`` on e4m3 rows ``qh`` with scales ``hs``, out in float32."""
    block, n_tile = tl.program_id(0), tl.program_id(1)
    if block * BLOCK_M >= tl.load(expert_ends_ptr + NUM_EXPERTS - 1):
        return
    expert, offs_r, pairs, row_ok = _block_rows(
        block, sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M
    )
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    rk = tl.arange(0, _BLOCK_K)
    w_rows = w2_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    w_scales = ws2_ptr + expert * stride_se + (n_tile * BLOCK_N // _BLOCK_K) * stride_sn
    rows = offs_r.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(inter, _BLOCK_K)):
        k = kb * _BLOCK_K + rk
        k_ok = k < inter
        q = tl.load(qh_ptr + rows[:, None] * stride_qr + k[None, :], mask=k_ok[None, :], other=0.0)
        scale = tl.load(hs_ptr + kb * num_rows + rows) * tl.load(w_scales + kb)
        acc = _scaled_block(acc, q, w_rows, k, k_ok, n_ok, scale, PRECISE)
    acc = acc * tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_op + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=row_ok[:, None] & n_ok[None, :])


def launch_gate_up_fp8(
    q,
    x_scale,
    w13,
    w13_scale,
    intermediate,
    groups,
    top_k: int,
    num_pairs: int,
    tile,
    precise: bool,
) -> None:
    """``x_scale`` [hidden / 128, num_tokens] as ``quantize_rows`` makes."""
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    grid = (groups.block_experts.numel(), triton.cdiv(inter, tile.block_n))
    _gate_up_fp8_kernel[grid](
        q,
        x_scale,
        w13,
        w13_scale,
        intermediate,
        groups.sorted_pairs,
        groups.block_experts,
        groups.expert_ends,
        num_pairs,
        q.shape[0],
        q.shape[1],
        inter,
        q.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale.stride(0),
        w13_scale.stride(1),
        intermediate.stride(0),
        TOP_K=top_k,
        NUM_EXPERTS=num_experts,
        PRECISE=precise,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def launch_down_fp8(
    qh, h_scale, w2, w2_scale, pair_out, topk_weights, groups, num_pairs: int, tile, precise: bool
) -> None:
    """``pair_out`` [num_pairs, hidden] float32; ``h_scale`` [inter / 128, max_padded_rows]."""
    num_experts, hidden, inter = w2.shape
    grid = (groups.block_experts.numel(), triton.cdiv(hidden, tile.block_n))
    _down_fp8_kernel[grid](
        qh,
        h_scale,
        w2,
        w2_scale,
        pair_out,
        topk_weights,
        groups.sorted_pairs,
        groups.block_experts,
        groups.expert_ends,
        num_pairs,
        qh.shape[0],
        hidden,
        inter,
        qh.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale.stride(0),
        w2_scale.stride(1),
        pair_out.stride(0),
        NUM_EXPERTS=num_experts,
        PRECISE=precise,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
