"""Triton kernels that write new K/V rows into the paged cache (used on the GPU by every backend):
a plain copy for a cache in the model's dtype, and a quantizing store for an FP8 cache."""
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
def _quantize_store(src, dst, scale_dst, mask, head_mask):
    """Quantize one token's [HEADS_PAD, DIM_PAD] tile with one scale per head (row), as
    ``attention_torch.quantize_fp8`` does: correctly rounded divisions, then round to nearest even."""
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 1), _FP8_MAX), _FP8_MIN_SCALE)  # [HEADS_PAD]
    values = tl.math.div_rn(x, scale[:, None]).to(dst.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(dst, values, mask=mask)
    tl.store(scale_dst, scale, mask=head_mask)


@triton.jit
def _store_kvcache_fp8_kernel(
    k_ptr, k_stride, v_ptr, v_stride, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
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
    scale_row = slot * NUM_KV_HEADS
    _quantize_store(k_ptr + token * k_stride + cols, k_cache_ptr + cache_row + cols, k_scale_ptr + scale_row + heads,
                    mask, head_mask)
    _quantize_store(v_ptr + token * v_stride + cols, v_cache_ptr + cache_row + cols, v_scale_ptr + scale_row + heads,
                    mask, head_mask)


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """k/v: [num_tokens, num_kv_heads, head_dim] (each token's row contiguous);
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous;
    for an FP8 cache (e4m3) also k_scale/v_scale: [num_blocks, block_size, num_kv_heads] float32, contiguous."""
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
    assert k_scale.dtype == v_scale.dtype == KV_SCALE_DTYPE and k_scale.is_contiguous() and v_scale.is_contiguous()
    assert k_scale.shape == v_scale.shape == k_cache.shape[:3]
    _store_kvcache_fp8_kernel[(num_tokens,)](
        k, k.stride(0), v, v.stride(0), k_cache, v_cache, k_scale, v_scale, slot_mapping,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )
