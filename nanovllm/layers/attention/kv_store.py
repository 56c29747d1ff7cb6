"""QK-norm, RoPE and the paged-cache store of a step's new tokens in one Triton kernel."""

import torch
import triton
import triton.language as tl

from nanovllm.layers.attention.fp8_kv import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from nanovllm.utils.dependent_launch import launch_options, pdl, wait_for_inputs

_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)


@triton.jit
def _fp8_scale(amax):
    # as fp8_kv.quantize_fp8
    return tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _FP8_MIN_SCALE)


@triton.jit
def _to_e4m3(x, scale):
    return tl.math.div_rn(x, scale[:, None]).to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _scale_offsets(slot, heads, block_size, stride_sb, stride_st, stride_sh):
    return (slot // block_size) * stride_sb + (slot % block_size) * stride_st + heads * stride_sh


@triton.jit
def _rotate_half(x1, x2, cos, sin, OUT_DTYPE: tl.constexpr):
    return (x1 * cos - x2 * sin).to(OUT_DTYPE), (x2 * cos + x1 * sin).to(OUT_DTYPE)


@triton.jit
def _load_halves(ptr, rows, row_mask, d, HALF: tl.constexpr):
    offs = rows[:, None] * (2 * HALF) + d[None, :]
    return (
        tl.load(ptr + offs, mask=row_mask[:, None], other=0.0),
        tl.load(ptr + HALF + offs, mask=row_mask[:, None], other=0.0),
    )


@triton.jit
def _norm_rope(
    ptr, rows, row_mask, d, w_ptr, eps, cos, sin, HALF: tl.constexpr, HAS_NORM: tl.constexpr
):
    """Per-head RMSNorm (HAS_NORM) and RoPE with ``rotary_embedding``'s roundings."""
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
def _cache_store(
    cache_ptr,
    scale_ptr,
    slot,
    rows,
    row_mask,
    d,
    x1,
    x2,
    scale_offsets,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    FP8: tl.constexpr,
):
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
    qkv_ptr,
    stride_qkv,
    positions_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_sin_ptr,
    eps,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    block_size,
    stride_sb,
    stride_st,
    stride_sh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    WRITE_K: tl.constexpr,
    STORE: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token; slot -1 stores nothing."""
    wait_for_inputs(PDL)
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
    _store_halves(
        q_out_ptr + token.to(tl.int64) * (NUM_HEADS * 2 * HALF), heads, q_mask, d, q1, q2, HALF
    )
    k_src = src + NUM_HEADS * 2 * HALF
    k1, k2 = _norm_rope(k_src, kv_heads, kv_mask, d, k_weight_ptr, eps, cos, sin, HALF, HAS_NORM)
    if WRITE_K:
        _store_halves(
            k_out_ptr + token.to(tl.int64) * (NUM_KV_HEADS * 2 * HALF),
            kv_heads,
            kv_mask,
            d,
            k1,
            k2,
            HALF,
        )
    if STORE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot != -1:
            v1, v2 = _load_halves(k_src + NUM_KV_HEADS * 2 * HALF, kv_heads, kv_mask, d, HALF)
            scales = _scale_offsets(slot, kv_heads, block_size, stride_sb, stride_st, stride_sh)
            _cache_store(
                k_cache_ptr,
                k_scale_ptr,
                slot,
                kv_heads,
                kv_mask,
                d,
                k1,
                k2,
                scales,
                NUM_KV_HEADS,
                HALF,
                FP8,
            )
            _cache_store(
                v_cache_ptr,
                v_scale_ptr,
                slot,
                kv_heads,
                kv_mask,
                d,
                v1,
                v2,
                scales,
                NUM_KV_HEADS,
                HALF,
                FP8,
            )


def rope_and_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos_sin_cache: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    write_k: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """q [num_tokens, num_heads, head_dim], k (None unless ``write_k``) and v (a view of qkv);
    ``norm``: (q weight, k weight, eps) or None; an empty ``k_cache`` stores nothing."""
    num_tokens = qkv.shape[0]
    head_dim = cos_sin_cache.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert (
        qkv.stride(-1) == 1
        and qkv.shape[1] == q_size + 2 * kv_size
        and cos_sin_cache.is_contiguous()
    )
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = (
        torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        if write_k
        else None
    )
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    store = k_cache.numel() > 0
    fp8 = store and k_cache.dtype == FP8_DTYPE
    if store:
        assert (
            k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and slot_mapping.numel() == num_tokens
        )
        assert not fp8 or (
            k_scale is not None and v_scale is not None and k_scale.stride() == v_scale.stride()
        )
    q_weight, k_weight, eps = norm if norm is not None else (None, None, 0.0)
    if num_tokens:
        _rope_store_kernel[(num_tokens,)](
            qkv,
            qkv.stride(0),
            positions,
            q_weight,
            k_weight,
            cos_sin_cache,
            eps,
            q,
            k,
            k_cache,
            v_cache,
            k_scale if fp8 else None,
            v_scale if fp8 else None,
            slot_mapping,
            k_cache.shape[1] if store else 1,
            *(k_scale.stride() if fp8 else (0, 0, 0)),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=head_dim // 2,
            HAS_NORM=norm is not None,
            WRITE_K=write_k,
            STORE=store,
            FP8=fp8,
            PDL=pdl(qkv.device),
            num_warps=4,
            **launch_options(qkv.device),
        )
    return q, k, v
