"""The one interface the attention backends implement, and the KV-cache layout they share
(docs/attention.md): one tensor [2, layers, blocks, block_size, kv_heads, head_dim]; slot ``s`` at
block ``s // block_size``, offset ``s % block_size``. An FP8 cache stores each (token, KV head) row
as ``x / s`` in e4m3 with ``s = max(max|x| / FP8_MAX, FP8_MIN_SCALE)``, its scales beside it."""

import torch

from nanovllm.utils.context import Context
from nanovllm.utils.float8 import FP8_DTYPE, FP8_MAX

__all__ = ["FP8_DTYPE", "FP8_MAX", "FP8_MIN_SCALE", "KV_SCALE_DTYPE", "AttentionBackend"]

FP8_MIN_SCALE = 2.0**-126  # the smallest normal float32: an all-zero row divides by this, not by 0
KV_SCALE_DTYPE = torch.float32


def is_fp8_kv_cache(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in ("fp8", "fp8_e4m3")


def empty_kv_scales(*shape: int, device=None) -> torch.Tensor:
    """Scales of shape ``[..., num_blocks, block_size, num_kv_heads]``, stored head-major
    (``[..., num_blocks, num_kv_heads, block_size]``), so the views are not contiguous."""
    return torch.empty(
        *shape[:-2], shape[-1], shape[-2], dtype=KV_SCALE_DTYPE, device=device
    ).transpose(-1, -2)


def kv_cache_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache tensor: e4m3 for an FP8 cache, else the model's dtype."""
    return FP8_DTYPE if is_fp8_kv_cache(kv_cache_dtype) else model_dtype


class AttentionBackend:
    """Shapes: q ``[tokens, num_heads, head_dim]``, k/v ``[tokens, num_kv_heads, head_dim]``;
    the output has q's shape. ``k_scale``/``v_scale``: an FP8 cache's row scales, else None.
    ``fuses_rope``: K/V reach the cache through ``kv_store.rope_and_store`` on a GPU (QK-norm,
    RoPE and the store in one kernel), else through ``store_kvcache``."""

    name = "base"
    fuses_rope = True
    # whether ``decode`` takes ``quantize=True``: the output handed to an FP8 o_proj as
    # ``QuantizedRows`` (one 128-channel group per head)
    quantizes_output = False

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        """Write each new token's K/V row into its cache slot (quantized, with its scales, for an
        FP8 cache); slot -1 is skipped."""
        raise NotImplementedError(
            f"attention backend {self.name!r} stores K/V through kv_store.rope_and_store"
        )

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
