"""Paged decode: one query per sequence over its cached keys, optionally split along the keys;
the last split of a (sequence, KV head) to finish merges them (one kernel either way)."""

import triton
import triton.language as tl

from nanovllm.layers.attention.triton_kernels import (
    MASKED,
    _dot,
    _fp8_query,
    _fp8_scores,
    _online_softmax_step,
)
from nanovllm.quantization.fp8_rows import quantize_store
from nanovllm.utils.dependent_launch import wait_for_inputs


@triton.jit
def _store_output(
    out,
    o_ptr,
    qo_ptr,
    qo_scale_ptr,
    seq,
    heads,
    head_mask,
    m_out,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    """Rows ``heads`` of one sequence's output in o's dtype; with QUANTIZE, e4m3 rows
    [m_out, NUM_HEADS * HEAD_DIM] and scales [NUM_HEADS, m_out] as ``quantize_rows`` makes."""
    offs_d = tl.arange(0, HEAD_DIM)
    out = out.to(o_ptr.dtype.element_ty)
    if QUANTIZE:
        values = (
            qo_ptr
            + seq.to(tl.int64) * (NUM_HEADS * HEAD_DIM)
            + heads[:, None] * HEAD_DIM
            + offs_d[None, :]
        )
        quantize_store(
            out.to(tl.float32),
            values,
            qo_scale_ptr + heads * m_out + seq,
            head_mask[:, None],
            head_mask,
        )
    else:
        tl.store(
            o_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out,
            mask=head_mask[:, None],
        )


# The batch sizes are not specialised on (eager decode would compile a variant for a batch of one).
@triton.jit(do_not_specialize=["num_seqs", "m_out"])
def _decode_kernel(
    q_ptr,
    o_ptr,
    part_acc_ptr,
    part_ml_ptr,
    counter_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    stride_qt,
    stride_qh,
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
    qo_ptr,
    qo_scale_ptr,
    num_seqs,
    m_out,  # QUANTIZE only (num_seqs: for the partial sums too)
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    TABLE_PAD: tl.constexpr,
    FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    PDL: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """The GROUP query heads of one KV head over one split of one sequence's keys; grid
    (num_kv_heads, num_seqs or m_out, NUM_SPLITS): programs launched together read neighbouring
    rows of the same tokens. Rows past num_seqs read nothing: zeros. Split, each program leaves its
    partial sums, and the last of a (sequence, KV head) to arrive merges them and sets its counter
    back to 0."""
    wait_for_inputs(PDL)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    real_seq = tl.minimum(seq, num_seqs - 1)  # a padding row reads a real row's q, and no key
    context_len = tl.where(seq < num_seqs, tl.load(context_lens_ptr + real_seq), 0)
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, context_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + real_seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )  # [GROUP_PAD, HEAD_DIM]
    row_scale = None
    if FP8:
        q, row_scale = _fp8_query(q, qk_scale, DOT_DTYPE)

    if TABLE_PAD:  # the sequence's block ids, held in registers
        offs_t = tl.arange(0, TABLE_PAD)
        num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
        table = tl.load(
            block_tables_ptr + real_seq * stride_bt + offs_t, mask=offs_t < num_blocks, other=0
        )

    m_i = tl.full([GROUP_PAD], MASKED, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        pos = start + offs_n
        kv_mask = pos < hi
        if TABLE_PAD:
            block = tl.sum(tl.where(offs_t == start // BLOCK_SIZE, table, 0))
            # the tile lies within one block: visibly consecutive
            offset = start % BLOCK_SIZE + offs_n
        else:
            block = tl.load(
                block_tables_ptr + real_seq * stride_bt + pos // BLOCK_SIZE, mask=kv_mask, other=0
            )
            offset = pos % BLOCK_SIZE
        row = block.to(tl.int64) * stride_cb + offset * stride_ct + kv_head * stride_ch
        k = tl.load(k_cache_ptr + row[None, :] + offs_d[:, None], mask=kv_mask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask[:, None], other=0.0)
        if FP8:
            scales = block.to(tl.int64) * stride_sb + offset * stride_st + kv_head * stride_sh
            qk, v_scale = _fp8_scores(
                q, row_scale, k, k_scale_ptr + scales, v_scale_ptr + scales, kv_mask, DOT_DTYPE
            )
        else:
            v_scale = None
            qk = _dot(q, k) * qk_scale  # [GROUP_PAD, BLOCK_N], log2 units
        qk = tl.where(kv_mask[None, :], qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v, v_scale, m_i, l_i, acc, FP8, DOT_DTYPE)

    last = True  # the program that writes the output: each, or the last of a split to arrive
    if NUM_SPLITS > 1:
        # part_acc: [rows, NUM_HEADS, NUM_SPLITS, HEAD_DIM]; part_ml: [2, rows, NUM_HEADS,
        # NUM_SPLITS], rows = the grid's
        first = (seq * NUM_HEADS + heads).to(tl.int64) * NUM_SPLITS
        l_offset = tl.num_programs(1) * NUM_HEADS * NUM_SPLITS
        part = first + split
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None]
        )
        tl.store(part_ml_ptr + part, m_i, mask=g_mask)
        tl.store(part_ml_ptr + l_offset + part, l_i, mask=g_mask)
        tl.debug_barrier()  # every partial sum is written before the count releases them
        counter = counter_ptr + seq * tl.num_programs(0) + kv_head
        last = tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1
    if last:
        if NUM_SPLITS > 1:
            acc, l_i = _merge_splits(
                part_acc_ptr, part_ml_ptr, first, l_offset, g_mask, NUM_SPLITS, GROUP_PAD, HEAD_DIM
            )
            tl.atomic_xchg(counter, 0)  # ready for the next call or graph replay
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no key (a padded row): zeros
        _store_output(
            out,
            o_ptr,
            qo_ptr,
            qo_scale_ptr,
            seq,
            heads,
            g_mask,
            m_out,
            stride_ot,
            stride_oh,
            NUM_HEADS,
            HEAD_DIM,
            QUANTIZE,
        )


@triton.jit
def _merge_splits(
    part_acc_ptr,
    part_ml_ptr,
    first,
    l_offset,
    g_mask,
    NUM_SPLITS: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The heads' (unnormalised output, softmax sum) from their NUM_SPLITS partial sums (read
    from L2, ".cg": other SMs wrote them)."""
    m = tl.full([GROUP_PAD], MASKED, tl.float32)
    for s in range(NUM_SPLITS):
        m_s = tl.load(part_ml_ptr + first + s, mask=g_mask, other=MASKED, cache_modifier=".cg")
        m = tl.maximum(m, m_s)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    offs_d = tl.arange(0, HEAD_DIM)
    for s in range(NUM_SPLITS):
        part = first + s
        m_s = tl.load(part_ml_ptr + part, mask=g_mask, other=MASKED, cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + l_offset + part, mask=g_mask, other=0.0, cache_modifier=".cg")
        weight = tl.exp2(m_s - m)
        total += l_s * weight
        acc_s = tl.load(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            mask=g_mask[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += weight[:, None] * acc_s
    return acc, total
