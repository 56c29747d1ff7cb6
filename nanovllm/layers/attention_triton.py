"""The project's own Triton attention kernels: variable-length causal prefill (keys from k/v or from
the paged cache) and paged decode, with a split-K variant for few sequences over long contexts.

Both kernels accumulate in float32 with an online (flash-style) softmax in base 2, and read the paged
cache one token row at a time through the block table, so any block size works.
"""
import functools
import math

import torch
import triton
import triton.language as tl

from nanovllm.layers.attention import AttentionBackend
from nanovllm.layers.kv_store import store_kvcache
from nanovllm.utils.context import Context

LOG2E = 1.4426950408889634
MASKED = tl.constexpr(-1.0e30)  # running max before any key is seen: finite, so exp2(MASKED - MASKED) is 1, not NaN


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc):
    """Fold one tile of scores (log2 units) and values into the running max, sum and output."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _prefill_tiles(
    q, m_i, l_i, acc, lo, hi, k_len, q_pos, q_start, seq, kv_head,
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch, stride_bt, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
):
    """Online-softmax accumulation over the key tiles [lo, hi); MASK applies the causal mask and
    the k_len bound (without it every key in the range must be visible to every query)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        kv_mask = pos < k_len
        if PAGED:
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=kv_mask, other=0)
            row = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
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
        qk = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASK:
            visible = kv_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_q_ptr, cu_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask[:, None], other=0.0)
    q_pos = k_len - q_len + offs_m  # query i sits after the sequence's k_len - q_len earlier keys

    m_i = tl.full([BLOCK_M], MASKED, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # key tiles below this tile's first query position need no mask; the rest (the diagonal and
    # the tail past k_len) do. The last query of the tile sees keys up to k_len - q_len + (m_block + 1) * BLOCK_M - 1.
    full_end = tl.minimum(k_len, k_len - q_len + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    end = tl.minimum(k_len, k_len - q_len + (m_block + 1) * BLOCK_M)
    m_i, l_i, acc = _prefill_tiles(
        q, m_i, l_i, acc, 0, full_end, k_len, q_pos, q_start, seq, kv_head,
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch, stride_bt, qk_scale,
        HEAD_DIM, BLOCK_SIZE, PAGED, BLOCK_N, False,
    )
    m_i, l_i, acc = _prefill_tiles(
        q, m_i, l_i, acc, full_end, end, k_len, q_pos, q_start, seq, kv_head,
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch, stride_bt, qk_scale,
        HEAD_DIM, BLOCK_SIZE, PAGED, BLOCK_N, True,
    )

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty), mask=q_mask[:, None],
    )


@triton.jit
def _decode_kernel(
    q_ptr, o_ptr, part_acc_ptr, part_ml_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
    qk_scale,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """One program: all GROUP query heads sharing one KV head, over one split of one sequence's
    context. With NUM_SPLITS == 1 it writes the output; otherwise unnormalised partial sums for
    ``_decode_reduce_kernel``. grid: (num_seqs, num_kv_heads, NUM_SPLITS)"""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, context_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None], other=0.0,
    )  # [GROUP_PAD, HEAD_DIM]

    m_i = tl.full([GROUP_PAD], MASKED, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        kv_mask = pos < hi
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=kv_mask, other=0)
        row = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        k = tl.load(k_cache_ptr + row[None, :] + offs_d[:, None], mask=kv_mask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask[:, None], other=0.0)
        qk = tl.dot(q, k) * qk_scale  # [GROUP_PAD, BLOCK_N], log2 units
        qk = tl.where(kv_mask[None, :], qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # context_len 0 (a padded row): zeros
        tl.store(
            o_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None],
        )
    else:
        # part_acc: [num_seqs, NUM_HEADS, NUM_SPLITS, HEAD_DIM]; part_ml: [2, num_seqs, NUM_HEADS, NUM_SPLITS]
        part = (seq * NUM_HEADS + heads).to(tl.int64) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + part, m_i, mask=g_mask)
        tl.store(part_ml_ptr + tl.num_programs(0) * NUM_HEADS * NUM_SPLITS + part, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    o_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Merge the splits of one (sequence, head). grid: (num_seqs, num_heads)"""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    part = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + part)
    l = tl.load(part_ml_ptr + tl.num_programs(0) * NUM_HEADS * NUM_SPLITS + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :])  # [NUM_SPLITS, HEAD_DIM]
    weight = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(l * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the Triton interpreter on the CPU: any small number exercises the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton attention kernels need head_dim to be a power of two >= 16, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have the same strides and contiguous rows")
    if q.stride(-1) != 1:
        raise ValueError("q must have contiguous rows (stride 1 in head_dim)")


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    PREFILL_TILES = (128, 64, 8, 3)  # BLOCK_M, BLOCK_N, num_warps, num_stages for long query runs
    SHORT_PREFILL_TILES = (64, 64, 4, 3)  # where no sequence has more than 64 new tokens, or head_dim > 128
    DECODE_BLOCK_N = 64
    MIN_TILES_PER_SPLIT = 4  # split-K only where each split still has this many key tiles to read

    def __init__(self, num_splits: int | None = None):
        """``num_splits``: key splits per sequence in decode (a power of two); None picks one from the
        batch size, the block-table width and the GPU's SM count."""
        if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
            raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
        self.num_splits = num_splits

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, context: Context, scale):
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        paged = context.block_tables is not None
        if paged:
            _check_shapes(q, k_cache, v_cache)
            num_kv_heads = k_cache.shape[2]
        elif k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("k and v must have contiguous rows (stride 1 in head_dim)")
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        num_seqs = context.cu_seqlens_q.numel() - 1
        if num_tokens == 0 or num_seqs == 0:
            return out
        short = context.max_seqlen_q <= 64 or head_dim > 128
        block_m, block_n, num_warps, num_stages = self.SHORT_PREFILL_TILES if short else self.PREFILL_TILES
        # without a paged cache these arguments are unused; pass q so every pointer is valid
        k_cache_arg, v_cache_arg, tables = (k_cache, v_cache, context.block_tables) if paged else (q, q, q)
        cache_strides = k_cache.stride()[:3] if paged else (0, 0, 0)
        grid = (triton.cdiv(context.max_seqlen_q, block_m), num_seqs, num_heads)
        _prefill_kernel[grid](
            q, k, v, out, k_cache_arg, v_cache_arg, tables, context.cu_seqlens_q, context.cu_seqlens_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            *cache_strides, tables.stride(0) if paged else 0,
            scale * LOG2E,
            GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1] if paged else 1,
            PAGED=paged, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
        )
        return out

    def decode(self, q, k_cache, v_cache, context: Context, scale):
        """CUDA-graph safe: no host syncs; the split count depends only on shapes."""
        _check_shapes(q, k_cache, v_cache)
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        group = num_heads // num_kv_heads
        tables = context.block_tables
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
        if num_seqs == 0:
            return out
        num_splits = self.num_splits or self._pick_num_splits(
            num_seqs * num_kv_heads, tables.shape[1] * block_size, q.device
        )
        if num_splits == 1:
            part_acc = part_ml = out  # unused
        else:
            part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(2, num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            q, out, part_acc, part_ml, k_cache, v_cache, tables, context.context_lens,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], tables.stride(0),
            scale * LOG2E,
            NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size, BLOCK_N=self.DECODE_BLOCK_N, NUM_SPLITS=num_splits,
            num_warps=4, num_stages=2,
        )
        if num_splits > 1:
            _decode_reduce_kernel[(num_seqs, num_heads)](
                out, part_acc, part_ml, out.stride(0), out.stride(1),
                NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, num_warps=4,
            )
        return out

    def _pick_num_splits(self, num_programs: int, max_context: int, device: torch.device) -> int:
        """Enough splits to give every SM about two programs, while each split keeps at least
        MIN_TILES_PER_SPLIT key tiles of the longest context the block tables can address."""
        max_tiles = math.ceil(max_context / self.DECODE_BLOCK_N)
        target = 2 * _num_sms(device)
        splits = 1
        while splits < 64 and num_programs * splits < target and max_tiles >= 2 * splits * self.MIN_TILES_PER_SPLIT:
            splits *= 2
        return splits
