"""The attention layer of every model: stores this step's K/V in the paged cache, then attends
through the backend the model runner chose (``selector``)."""

import torch
from torch import nn

from nanovllm.layers.attention.interface import AttentionBackend
from nanovllm.quantization.fp8 import QuantizedRows
from nanovllm.utils.context import Context, get_context


class Attention(nn.Module):
    """Stores this step's K/V in the paged cache, then attends. The model runner sets
    ``k_cache``, ``v_cache`` (and for an FP8 cache ``k_scale``, ``v_scale``) and ``backend`` once
    the cache exists."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        # set by the model where an FP8 o_proj reads the output (head_dim 128): decode then hands it
        # quantized where the backend can (``AttentionBackend.quantizes_output``)
        self.quantize_output = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor | QuantizedRows:
        """The plain path (the torch backend): q, k, v already normed and rotated."""
        context = get_context()
        if self.k_cache.numel():
            self.backend.store_kvcache(
                k, v, self.k_cache, self.v_cache, context.slot_mapping, self.k_scale, self.v_scale
            )
        return self._attend(q, k, v, context)

    def fuses_rope(self, x: torch.Tensor) -> bool:
        """Whether ``rope_store_attend`` takes ``x``'s step: on a GPU, for the kernel backends (the
        torch backend stays the plain reference path)."""
        return x.is_cuda and self.backend.name != "torch"

    def rope_store_attend(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    ) -> torch.Tensor | QuantizedRows:
        """``forward`` from the fused projection: QK-norm (``norm``), RoPE and the cache store in
        one kernel (``kv_store.rope_and_store``), then attention."""
        from nanovllm.layers.attention.kv_store import (
            rope_and_store,
        )  # imports triton: only on this path

        context = get_context()
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

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor, context: Context
    ) -> torch.Tensor | QuantizedRows:
        scales = (self.k_scale, self.v_scale)
        if context.is_prefill:
            return self.backend.prefill(
                q, k, v, self.k_cache, self.v_cache, context, self.scale, *scales
            )
        if self.quantize_output and self.backend.quantizes_output:
            return self.backend.decode(
                q, self.k_cache, self.v_cache, context, self.scale, *scales, quantize=True
            )
        return self.backend.decode(q, self.k_cache, self.v_cache, context, self.scale, *scales)
