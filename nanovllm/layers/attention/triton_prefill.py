"""Variable-length causal prefill: keys from k/v, or from the paged cache (any block size, read
one token row at a time through the block table; e4m3 with ``FP8``)."""

import triton
import triton.language as tl

from nanovllm.layers.attention.triton_kernels import (
    MASKED,
    _dot,
    _fp8_query,
    _fp8_scores,
    _online_softmax_step,
)


@triton.jit
def _prefill_tiles(
    q,
    row_scale,
    m_i,
    l_i,
    acc,
    lo,
    hi,
    k_len,
    q_pos,
    q_start,
    seq,
    kv_head,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_st,
    stride_sh,
    stride_bt,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Online softmax over the key tiles [lo, hi); without MASK (causal and k_len bound) every key
    there must be visible to every query. FP8 only with PAGED (q, row_scale from ``_fp8_query``)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        kv_mask = pos < k_len
        if PAGED:
            block = tl.load(
                block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=kv_mask, other=0
            )
            row = (
                block.to(tl.int64) * stride_cb
                + (pos % BLOCK_SIZE) * stride_ct
                + kv_head * stride_ch
            )
            k_ptrs = k_cache_ptr + row[None, :] + offs_d[:, None]  # [HEAD_DIM, BLOCK_N]
            v_ptrs = v_cache_ptr + row[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
        else:
            k_rows = (q_start + pos).to(tl.int64)
            k_ptrs = k_ptr + k_rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]
            v_ptrs = v_ptr + k_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
        if MASK:
            k = tl.load(k_ptrs, mask=kv_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if FP8:
            scales = (
                block.to(tl.int64) * stride_sb
                + (pos % BLOCK_SIZE) * stride_st
                + kv_head * stride_sh
            )
            qk, v_scale = _fp8_scores(
                q, row_scale, k, k_scale_ptr + scales, v_scale_ptr + scales, kv_mask, DOT_DTYPE
            )
        else:
            v_scale = None
            qk = _dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASK:
            visible = kv_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v, v_scale, m_i, l_i, acc, FP8, DOT_DTYPE)
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_q_ptr,
    cu_k_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    qk_scale,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_st,
    stride_sh,  # FP8 only
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """BLOCK_M queries of one sequence and one query head; grid (cdiv(max_seqlen_q, BLOCK_M),
    num_seqs, num_heads)."""
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    if PAGED:
        k_len = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    else:
        k_len = q_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_mask = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=q_mask[:, None],
        other=0.0,
    )
    q_pos = k_len - q_len + offs_m  # query i sits after the sequence's k_len - q_len earlier keys
    row_scale = None
    if FP8:
        q, row_scale = _fp8_query(q, qk_scale, DOT_DTYPE)

    m_i = tl.full([BLOCK_M], MASKED, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # key tiles below this tile's first query position need no mask; the rest (the diagonal and
    # the tail past k_len) do. The tile's last query sees keys up to
    # k_len - q_len + (m_block + 1) * BLOCK_M - 1.
    full_end = tl.minimum(k_len, k_len - q_len + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    end = tl.minimum(k_len, k_len - q_len + (m_block + 1) * BLOCK_M)
    m_i, l_i, acc = _prefill_tiles(
        q,
        row_scale,
        m_i,
        l_i,
        acc,
        0,
        full_end,
        k_len,
        q_pos,
        q_start,
        seq,
        kv_head,
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        block_tables_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cb,
        stride_ct,
        stride_ch,
        stride_sb,
        stride_st,
        stride_sh,
        stride_bt,
        qk_scale,
        HEAD_DIM,
        BLOCK_SIZE,
        PAGED,
        BLOCK_N,
        False,
        FP8,
        DOT_DTYPE,
    )
    m_i, l_i, acc = _prefill_tiles(
        q,
        row_scale,
        m_i,
        l_i,
        acc,
        full_end,
        end,
        k_len,
        q_pos,
        q_start,
        seq,
        kv_head,
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        block_tables_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cb,
        stride_ct,
        stride_ch,
        stride_sb,
        stride_st,
        stride_sh,
        stride_bt,
        qk_scale,
        HEAD_DIM,
        BLOCK_SIZE,
        PAGED,
        BLOCK_N,
        True,
        FP8,
        DOT_DTYPE,
    )

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=q_mask[:, None],
    )
