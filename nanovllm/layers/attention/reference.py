"""Plain torch attention: the CPU path, and the reference for the GPU backends."""

import torch
import torch.nn.functional as F

from nanovllm.layers.attention.interface import AttentionBackend
from nanovllm.utils.context import Context


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """cache [num_blocks, block_size, ...] -> the first [num_tokens, ...] rows of a sequence."""
    block_size = cache.size(1)
    num_blocks = (num_tokens + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:num_tokens]


def gather_dequantized(
    cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    rows = gather_kv(cache, block_table, num_tokens)
    if scale is None:
        return rows
    return rows.float() * gather_kv(scale, block_table, num_tokens).unsqueeze(-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float32 of the last ``len(q)`` positions over ``len(k)`` keys."""
    num_q, num_heads, _ = q.shape
    num_k, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    # query i sits at position num_k - num_q + i and sees keys 0..that position
    mask = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).tril(num_k - num_q)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )  # [num_heads, num_q, head_dim]
    return out.transpose(0, 1).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    fuses_rope = False

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            rows = x[valid]  # [num_valid, num_kv_heads, head_dim]
            if scale is not None:
                from nanovllm.layers.attention.fp8_kv import quantize_fp8

                rows, row_scales = quantize_fp8(rows)
                block_size = scale.shape[1]  # the scales may be stored head-major: index them
                scale[slots // block_size, slots % block_size] = row_scales
                cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)  # no e4m3 index_copy_
            cache.flatten(0, 1).index_copy_(0, slots, rows.to(cache.dtype))

    def prefill(
        self, q, k, v, k_cache, v_cache, context: Context, scale, k_scale=None, v_scale=None
    ):
        out = torch.empty_like(q)
        cu_q = context.cu_seqlens_q.tolist()
        cu_k = context.cu_seqlens_k.tolist()
        for i in range(len(cu_q) - 1):
            q_start, q_end = cu_q[i], cu_q[i + 1]
            if context.block_tables is None:
                ki, vi = k[q_start:q_end], v[q_start:q_end]
            else:
                num_k = cu_k[i + 1] - cu_k[i]
                ki = gather_dequantized(k_cache, k_scale, context.block_tables[i], num_k)
                vi = gather_dequantized(v_cache, v_scale, context.block_tables[i], num_k)
            out[q_start:q_end] = attend(q[q_start:q_end], ki, vi, scale)
        return out

    def decode(self, q, k_cache, v_cache, context: Context, scale, k_scale=None, v_scale=None):
        out = torch.empty_like(q)
        for i, num_k in enumerate(context.context_lens.tolist()):
            ki = gather_dequantized(k_cache, k_scale, context.block_tables[i], num_k)
            vi = gather_dequantized(v_cache, v_scale, context.block_tables[i], num_k)
            out[i : i + 1] = attend(q[i : i + 1], ki, vi, scale)
        return out
