"""The one interface the attention backends implement. The KV cache they share is one tensor
[2, layers, blocks, block_size, kv_heads, head_dim]; slot ``s`` is at block ``s // block_size``,
offset ``s % block_size``. An FP8 cache's format: ``fp8_kv``."""

import torch

from nanovllm.utils.context import Context

_FP8_NAMES = ("FP8_DTYPE", "FP8_MAX", "FP8_MIN_SCALE", "KV_SCALE_DTYPE", "empty_kv_scales")


def __getattr__(name: str):  # the FP8 cache's names load with it, not with this interface
    if name in _FP8_NAMES:
        import nanovllm.layers.attention.fp8_kv as fp8_kv

        return getattr(fp8_kv, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_fp8_kv_cache(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in ("fp8", "fp8_e4m3")


class AttentionBackend:
    """q ``[tokens, num_heads, head_dim]``, k/v ``[tokens, num_kv_heads, head_dim]``; the output
    has q's shape. ``k_scale``/``v_scale``: an FP8 cache's row scales, else None. ``fuses_rope``:
    on a GPU K/V reach the cache through ``kv_store.rope_and_store``, else ``store_kvcache``.
    ``quantizes_output``: ``decode`` takes ``quantize=True`` (rows for an FP8 o_proj)."""

    name = "base"
    fuses_rope = True
    quantizes_output = False

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        """Write each new token's K/V row into its slot (quantized for an FP8 cache); -1: skip."""
        raise NotImplementedError(f"attention backend {self.name!r} stores K/V in rope_and_store")

    def prefill(
        self, q, k, v, k_cache, v_cache, context: Context, scale: float, k_scale=None, v_scale=None
    ) -> torch.Tensor:
        """Causal attention over variable-length sequences: keys ``k``/``v``, or with
        ``context.block_tables`` the paged cache (the new tokens already stored)."""
        raise NotImplementedError

    def decode(
        self, q, k_cache, v_cache, context: Context, scale: float, k_scale=None, v_scale=None
    ) -> torch.Tensor:
        """One query per sequence over its ``context.context_lens`` cached tokens."""
        raise NotImplementedError
