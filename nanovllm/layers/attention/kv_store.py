"""Triton kernels that write new K/V rows into the paged cache (used on the GPU by every backend):
a plain copy for a cache in the model's dtype, and a quantizing store for an FP8 cache; and
``rope_and_store``, which also does the QK-norm and RoPE of the new tokens in the same pass."""
import torch
import triton
import triton.language as tl

from nanovllm.layers.attention import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, KV_SCALE_DTYPE

_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)


@triton.jit
def _store_kvcache_kernel(
    k_ptr, k_stride, v_ptr, v_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot == -1:
        return
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    k = tl.load(k_ptr + token * k_stride + cols, mask=mask)
    v = tl.load(v_ptr + token * v_stride + cols, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + cols, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, v, mask=mask)


@triton.jit
def _fp8_scale(amax):
    """Each row's scale from its max |x|, as ``attention_torch.quantize_fp8`` computes it."""
    return tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _FP8_MIN_SCALE)


@triton.jit
def _to_e4m3(x, scale):
    """A float32 [rows, cols] tile divided by its rows' scales (correctly rounded), then rounded
    to nearest even in e4m3."""
    return tl.math.div_rn(x, scale[:, None]).to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _scale_offsets(slot, heads, block_size, stride_sb, stride_st, stride_sh):
    """Where the scales of ``heads`` of cache slot ``slot`` live, in a scale tensor of any strides
    ([num_blocks, block_size, num_kv_heads])."""
    return (slot // block_size) * stride_sb + (slot % block_size) * stride_st + heads * stride_sh


@triton.jit
def _quantize_store(src, dst, scale_dst, mask, head_mask):
    """Quantize one token's [HEADS_PAD, DIM_PAD] tile with one scale per head (row) and store it."""
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    scale = _fp8_scale(tl.max(tl.abs(x), 1))
    tl.store(dst, _to_e4m3(x, scale), mask=mask)
    tl.store(scale_dst, scale, mask=head_mask)


@triton.jit
def _store_kvcache_fp8_kernel(
    k_ptr, k_stride, v_ptr, v_stride, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    block_size, stride_sb, stride_st, stride_sh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    """One program per token: per-head amax, scale and cast for its K and V rows."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot == -1:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    head_mask = heads < NUM_KV_HEADS
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
    cols = heads[:, None] * HEAD_DIM + dims[None, :]  # [HEADS_PAD, DIM_PAD], offsets within one token's row
    cache_row = slot * (NUM_KV_HEADS * HEAD_DIM)
    scales = _scale_offsets(slot, heads, block_size, stride_sb, stride_st, stride_sh)
    _quantize_store(k_ptr + token * k_stride + cols, k_cache_ptr + cache_row + cols, k_scale_ptr + scales,
                    mask, head_mask)
    _quantize_store(v_ptr + token * v_stride + cols, v_cache_ptr + cache_row + cols, v_scale_ptr + scales,
                    mask, head_mask)


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """k/v: [num_tokens, num_kv_heads, head_dim] (each token's row contiguous);
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous;
    for an FP8 cache (e4m3) also k_scale/v_scale: [num_blocks, block_size, num_kv_heads] float32, any
    strides (the same for both)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    row = num_kv_heads * head_dim
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(1) == head_dim and v.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.numel() == num_tokens
    if k_cache.dtype != FP8_DTYPE:
        _store_kvcache_kernel[(num_tokens,)](
            k, k.stride(0), v, v.stride(0), k_cache, v_cache, slot_mapping,
            ROW=row, BLOCK=triton.next_power_of_2(row),
        )
        return
    assert k_scale is not None and v_scale is not None, "an FP8 cache needs k_scale and v_scale"
    assert k_scale.dtype == v_scale.dtype == KV_SCALE_DTYPE and k_scale.stride() == v_scale.stride()
    assert k_scale.shape == v_scale.shape == k_cache.shape[:3]
    _store_kvcache_fp8_kernel[(num_tokens,)](
        k, k.stride(0), v, v.stride(0), k_cache, v_cache, k_scale, v_scale, slot_mapping,
        k_cache.shape[1], *k_scale.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _rotate_half(x1, x2, cos, sin, OUT_DTYPE: tl.constexpr):
    """Rotate-half RoPE of a [heads, dim] tile given as its two halves, in float32."""
    return (x1 * cos - x2 * sin).to(OUT_DTYPE), (x2 * cos + x1 * sin).to(OUT_DTYPE)


@triton.jit
def _load_halves(ptr, rows, row_mask, d, HALF: tl.constexpr):
    """One token's heads [rows, 2 * HALF] read from ``ptr``, as their two halves."""
    offs = rows[:, None] * (2 * HALF) + d[None, :]
    return (tl.load(ptr + offs, mask=row_mask[:, None], other=0.0),
            tl.load(ptr + HALF + offs, mask=row_mask[:, None], other=0.0))


@triton.jit
def _norm_rope(ptr, rows, row_mask, d, w_ptr, eps, cos, sin, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """One token's heads read from ``ptr``: per-head RMSNorm (HAS_NORM), then RoPE, with
    ``rotary_embedding``'s arithmetic and roundings. Returns the two halves."""
    x1, x2 = _load_halves(ptr, rows, row_mask, d, HALF)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        r = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
        x1 = (w1[None, :] * (x1 * r[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2[None, :] * (x2 * r[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return _rotate_half(x1, x2, cos[None, :], sin[None, :], dtype)


@triton.jit
def _store_halves(ptr, rows, row_mask, d, x1, x2, HALF: tl.constexpr):
    tl.store(ptr + rows[:, None] * (2 * HALF) + d[None, :], x1, mask=row_mask[:, None])
    tl.store(ptr + rows[:, None] * (2 * HALF) + HALF + d[None, :], x2, mask=row_mask[:, None])


@triton.jit
def _cache_store(cache_ptr, scale_ptr, slot, rows, row_mask, d, x1, x2, scale_offsets,
                 NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr):
    """One token's K or V heads, given as their two halves, into its cache slot (for FP8
    quantized, one scale per head, stored at ``scale_ptr + scale_offsets``)."""
    row = cache_ptr + slot * (NUM_KV_HEADS * 2 * HALF)
    if FP8:
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        scale = _fp8_scale(tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1)))
        _store_halves(row, rows, row_mask, d, _to_e4m3(x1, scale), _to_e4m3(x2, scale), HALF)
        tl.store(scale_ptr + scale_offsets, scale, mask=row_mask)
    else:
        dtype = cache_ptr.dtype.element_ty
        _store_halves(row, rows, row_mask, d, x1.to(dtype), x2.to(dtype), HALF)


@triton.jit
def _rope_store_kernel(
    qkv_ptr, stride_qkv, positions_ptr, q_weight_ptr, k_weight_ptr, cos_sin_ptr, eps,
    q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    block_size, stride_sb, stride_st, stride_sh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, WRITE_K: tl.constexpr, STORE: tl.constexpr, FP8: tl.constexpr,
):
    """One program per token: its q and k heads normalised (HAS_NORM) and rotated, q (and k, with
    WRITE_K) written out, k and v stored into the cache slot (STORE; slot -1 skips)."""
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + d).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + d).to(tl.float32)
    src = qkv_ptr + token.to(tl.int64) * stride_qkv
    heads = tl.arange(0, HEADS_PAD)
    kv_heads = tl.arange(0, KV_HEADS_PAD)
    q_mask, kv_mask = heads < NUM_HEADS, kv_heads < NUM_KV_HEADS
    q1, q2 = _norm_rope(src, heads, q_mask, d, q_weight_ptr, eps, cos, sin, HALF, HAS_NORM)
    _store_halves(q_out_ptr + token.to(tl.int64) * (NUM_HEADS * 2 * HALF), heads, q_mask, d, q1, q2, HALF)
    k_src = src + NUM_HEADS * 2 * HALF
    k1, k2 = _norm_rope(k_src, kv_heads, kv_mask, d, k_weight_ptr, eps, cos, sin, HALF, HAS_NORM)
    if WRITE_K:
        _store_halves(k_out_ptr + token.to(tl.int64) * (NUM_KV_HEADS * 2 * HALF), kv_heads, kv_mask, d, k1, k2, HALF)
    if STORE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot != -1:
            v1, v2 = _load_halves(k_src + NUM_KV_HEADS * 2 * HALF, kv_heads, kv_mask, d, HALF)
            scales = _scale_offsets(slot, kv_heads, block_size, stride_sb, stride_st, stride_sh)
            _cache_store(k_cache_ptr, k_scale_ptr, slot, kv_heads, kv_mask, d, k1, k2, scales, NUM_KV_HEADS, HALF, FP8)
            _cache_store(v_cache_ptr, v_scale_ptr, slot, kv_heads, kv_mask, d, v1, v2, scales, NUM_KV_HEADS, HALF, FP8)


def rope_and_store(
    qkv: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int, cos_sin_cache: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor | None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    write_k: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A step's new tokens from the fused projection qkv [num_tokens, (num_heads + 2 * num_kv_heads)
    * head_dim]: QK-norm (``norm`` = (q weight, k weight, eps); None: none), rotate-half RoPE from
    ``cos_sin_cache`` [max_position, 1, head_dim] float32, and the store of k and v into their cache
    slots (an empty ``k_cache``: no store), in one kernel. Returns q [num_tokens, num_heads,
    head_dim], k (rotated; None unless ``write_k``) and v (a view of qkv)."""
    num_tokens = qkv.shape[0]
    head_dim = cos_sin_cache.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert qkv.stride(-1) == 1 and qkv.shape[1] == q_size + 2 * kv_size and cos_sin_cache.is_contiguous()
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device) if write_k else None
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    store = k_cache.numel() > 0
    fp8 = store and k_cache.dtype == FP8_DTYPE
    if store:
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.numel() == num_tokens
        assert not fp8 or (k_scale is not None and v_scale is not None and k_scale.stride() == v_scale.stride())
    q_weight, k_weight, eps = norm if norm is not None else (None, None, 0.0)
    if num_tokens:
        _rope_store_kernel[(num_tokens,)](
            qkv, qkv.stride(0), positions, q_weight, k_weight, cos_sin_cache, eps,
            q, k, k_cache, v_cache, k_scale if fp8 else None, v_scale if fp8 else None, slot_mapping,
            k_cache.shape[1] if store else 1, *(k_scale.stride() if fp8 else (0, 0, 0)),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HALF=head_dim // 2, HAS_NORM=norm is not None,
            WRITE_K=write_k, STORE=store, FP8=fp8, num_warps=4,
        )
    return q, k, v
