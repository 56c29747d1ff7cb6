"""The one interface the attention backends implement (the KV-cache layout: docs/attention.md)."""

import torch

from nanovllm.utils.context import Context


def is_fp8_kv_cache(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in ("fp8", "fp8_e4m3")


class AttentionBackend:
    """q [tokens, heads, head_dim], k/v [tokens, kv_heads, head_dim] -> q's shape;
    ``k_scale``/``v_scale``: an FP8 cache's scales, else None."""

    name = "base"
    fuses_rope = True
    quantizes_output = False

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        raise NotImplementedError(f"attention backend {self.name!r} stores K/V in rope_and_store")

    def prefill(
        self, q, k, v, k_cache, v_cache, context: Context, scale: float, k_scale=None, v_scale=None
    ) -> torch.Tensor:
        raise NotImplementedError

    def decode(
        self, q, k_cache, v_cache, context: Context, scale: float, k_scale=None, v_scale=None
    ) -> torch.Tensor:
        raise NotImplementedError
