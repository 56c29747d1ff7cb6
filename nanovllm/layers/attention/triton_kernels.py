"""The project's own Triton attention kernels: variable-length causal prefill (keys from k/v or from
the paged cache), and the steps every kernel shares (the paged decode kernels, in
``triton_decode.py``, use them too). ``triton_backend.py`` chooses their tiles and launches them.

Both kernels accumulate in float32 with an online (flash-style) softmax in base 2, and read the paged
cache one token row at a time through the block table, so any block size works. With ``FP8`` (a
compile-time switch; the paged reads only) the cache holds e4m3 values and one float32 scale per
(token, KV head), and no tile is dequantized: e4m3 converts exactly and cheaply to float16 (one
instruction per two values), so both dots run in DOT_DTYPE (float16, or float32 for a float32
model) on operands scaled into (-2, 2). q is divided by a power of two near its row's max |q|
once (exact); the K scales then multiply the scores. P is multiplied by the V scales and divided by each row's largest such
weight, which multiplies the tile's P @ V back. Everything else stays float32.
"""

import os

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MASKED = tl.constexpr(
    -1.0e30
)  # running max before any key is seen: finite, so exp2(MASKED - MASKED) is 1, not NaN
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")  # no inline PTX there


@triton.jit
def _dot(a, b):
    """a @ b, accumulated in float32; float32 operands multiply in full float32 (Triton's default
    for them is TF32, about 1e-3 relative error, which a float32 model must not get)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _e4m3_tile(v, DOT_DTYPE: tl.constexpr):
    """An e4m3 value tile [BLOCK_N, HEAD_DIM] in DOT_DTYPE for the P @ V dot. Converting it to
    float16 here, in the layout it was loaded in, is what makes the dot fast: left to itself the
    compiler converts after reading the tile in the dot's layout, which for an 8-bit operand that is
    contiguous along N means one shared-memory read per byte. The conversion is opaque PTX (not
    ``is_pure``), so it stays here, and the float16 tile takes the transposing 16-bit path instead."""
    if DOT_DTYPE == tl.float16 and not INTERPRETED:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r",
            [v],
            dtype=tl.float16,
            is_pure=False,
            pack=4,
        )
    return v.to(DOT_DTYPE)


@triton.jit
def _online_softmax_step(qk, v, v_scale, m_i, l_i, acc, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Fold one tile of scores (log2 units) and values into the running max, sum and output.
    FP8: ``v`` is e4m3 and ``v_scale`` its per-key scales, which weight the probabilities of the
    output but not of the running sum."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        w = p * v_scale[None, :]
        w_max = tl.max(w, 1)
        w_max = tl.where(w_max == 0.0, 1.0, w_max)
        pv = _dot((w / w_max[:, None]).to(DOT_DTYPE), _e4m3_tile(v, DOT_DTYPE))
        acc = acc * alpha[:, None] + pv * w_max[:, None]
    else:
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _fp8_query(q, qk_scale, DOT_DTYPE: tl.constexpr):
    """q [rows, HEAD_DIM] divided by a power of two per row (max |q| with its mantissa cleared),
    so that it lies in (-2, 2) and a bf16 q converts to float16 exactly; and the per-row factor
    (that power times qk_scale) which turns its dot with e4m3 keys into scores in log2 units."""
    q = q.to(tl.float32)
    q_max = tl.max(tl.abs(q), 1)
    power = (q_max.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    power = tl.where(power == 0.0, 1.0, power)  # an all-zero (or subnormal) row
    return (q / power[:, None]).to(DOT_DTYPE), power * qk_scale


@triton.jit
def _fp8_scores(q, row_scale, k, k_scale_ptrs, v_scale_ptrs, kv_mask, DOT_DTYPE: tl.constexpr):
    """Scores (log2 units) of a ``_fp8_query`` q against an e4m3 key tile k [HEAD_DIM, BLOCK_N],
    each key's scale applied to its column, and the keys' V scales (for ``_online_softmax_step``)."""
    k_scale = tl.load(k_scale_ptrs, mask=kv_mask, other=0.0)
    v_scale = tl.load(v_scale_ptrs, mask=kv_mask, other=0.0)
    return _dot(q, k.to(DOT_DTYPE)) * row_scale[:, None] * k_scale[None, :], v_scale


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
    """Online-softmax accumulation over the key tiles [lo, hi); MASK applies the causal mask and
    the k_len bound (without it every key in the range must be visible to every query).
    FP8 is set only with PAGED; q and row_scale are then ``_fp8_query``'s."""
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
    """One program: BLOCK_M queries of one sequence and one query head.
    grid: (cdiv(max_seqlen_q, BLOCK_M), num_seqs, num_heads)"""
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
    # the tail past k_len) do. The last query of the tile sees keys up to k_len - q_len + (m_block + 1) * BLOCK_M - 1.
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
