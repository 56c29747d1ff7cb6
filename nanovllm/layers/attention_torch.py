"""Plain torch attention: the CPU path, and the reference the GPU backends are tested against."""
import torch
import torch.nn.functional as F

from nanovllm.layers.attention import AttentionBackend
from nanovllm.utils.context import Context


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` rows a sequence stored through ``block_table``.
    cache: [num_blocks, block_size, num_kv_heads, head_dim] -> [num_tokens, num_kv_heads, head_dim]"""
    block_size = cache.size(1)
    num_blocks = (num_tokens + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:num_tokens]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions of one sequence over its ``len(k)`` keys,
    in float32. q: [num_q, num_heads, head_dim], k/v: [num_k, num_kv_heads, head_dim]."""
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

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        k_cache.flatten(0, 1).index_copy_(0, slots, k[valid].to(k_cache.dtype))
        v_cache.flatten(0, 1).index_copy_(0, slots, v[valid].to(v_cache.dtype))

    def prefill(self, q, k, v, k_cache, v_cache, context: Context, scale):
        out = torch.empty_like(q)
        cu_q = context.cu_seqlens_q.tolist()
        cu_k = context.cu_seqlens_k.tolist()
        for i in range(len(cu_q) - 1):
            q_start, q_end = cu_q[i], cu_q[i + 1]
            if context.block_tables is None:
                ki, vi = k[q_start:q_end], v[q_start:q_end]
            else:
                num_k = cu_k[i + 1] - cu_k[i]
                ki = gather_kv(k_cache, context.block_tables[i], num_k)
                vi = gather_kv(v_cache, context.block_tables[i], num_k)
            out[q_start:q_end] = attend(q[q_start:q_end], ki, vi, scale)
        return out

    def decode(self, q, k_cache, v_cache, context: Context, scale):
        out = torch.empty_like(q)
        for i, num_k in enumerate(context.context_lens.tolist()):
            ki = gather_kv(k_cache, context.block_tables[i], num_k)
            vi = gather_kv(v_cache, context.block_tables[i], num_k)
            out[i : i + 1] = attend(q[i : i + 1], ki, vi, scale)
        return out
