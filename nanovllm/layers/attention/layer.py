"""The attention layer of every model: RoPE, the K/V store and the chosen backend."""

import torch
from torch import nn

from nanovllm.layers.attention.interface import AttentionBackend
from nanovllm.layers.rotary_embedding import apply_qk_norm_rotary_emb, apply_rotary_emb
from nanovllm.utils.context import Context, get_context


class Attention(nn.Module):
    """The model runner sets ``k_cache``/``v_cache`` (``k_scale``/``v_scale``) and ``backend``."""

    def __init__(self, num_heads, head_dim, scale: float, num_kv_heads, quantize_output=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.quantize_output = quantize_output

    def forward(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ):
        """qkv [tokens, (heads + 2 * kv_heads) * head_dim] -> [tokens, heads * head_dim];
        ``norm``: QK-norm's (q weight, k weight, eps)."""
        context = get_context()
        if qkv.is_cuda and self.backend.fuses_rope:
            from nanovllm.layers.attention.kv_store import rope_and_store  # imports triton

            q, k, v = rope_and_store(
                qkv,
                positions,
                self.num_heads,
                self.num_kv_heads,
                cos_sin_cache,
                norm,
                self.k_cache,
                self.v_cache,
                context.slot_mapping,
                self.k_scale,
                self.v_scale,
                write_k=context.is_prefill,
            )
            return self._attend(q, k, v, context)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if norm is not None:
            q, k = apply_qk_norm_rotary_emb(positions, q, k, *norm, cos_sin_cache)
        else:
            q, k = apply_rotary_emb(positions, q, k, cos_sin_cache)
        if self.k_cache.numel():
            self.backend.store_kvcache(
                k, v, self.k_cache, self.v_cache, context.slot_mapping, self.k_scale, self.v_scale
            )
        return self._attend(q, k, v, context)

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor, context: Context):
        scales = (self.k_scale, self.v_scale)
        if context.is_prefill:
            o = self.backend.prefill(
                q, k, v, self.k_cache, self.v_cache, context, self.scale, *scales
            )
        elif self.quantize_output and self.backend.quantizes_output:
            return self.backend.decode(
                q, self.k_cache, self.v_cache, context, self.scale, *scales, quantize=True
            )
        else:
            o = self.backend.decode(q, self.k_cache, self.v_cache, context, self.scale, *scales)
        return o.flatten(1, -1)
