"""The one interface the attention backends implement, and the KV-cache layout they share (the
element types of a cache in the model's dtype or in FP8, and where the scales of an FP8 cache live).
No backend is imported here: the backends import this module, ``selector`` picks among them.

KV-cache layout (owned by the model runner): one tensor ``[2, num_layers, num_blocks, block_size,
num_kv_heads, head_dim]``; each layer sees ``k_cache``/``v_cache`` views of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token slot ``s`` lives at block
``s // block_size``, offset ``s % block_size``.

FP8 cache (``kv_cache_dtype="fp8"``): the cache holds ``float8_e4m3fn`` values, and a second tensor
of float32 holds one scale per (token, KV head) row, seen by each layer as ``k_scale``/``v_scale``
``[num_blocks, block_size, num_kv_heads]`` (``empty_kv_scales``: stored head-major, so those views
are not contiguous; the kernels take any strides).
A row ``x`` is stored as ``x / s`` in e4m3 with ``s = max(max|x| / FP8_MAX, FP8_MIN_SCALE)``; it
reads back as ``stored * s``.
"""

import torch

from nanovllm.utils.context import Context

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
FP8_MIN_SCALE = 2.0**-126  # the smallest normal float32: an all-zero row divides by this, not by 0
KV_SCALE_DTYPE = torch.float32


def is_fp8_kv_cache(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in ("fp8", "fp8_e4m3")


def empty_kv_scales(*shape: int, device=None) -> torch.Tensor:
    """Scales of shape ``[..., num_blocks, block_size, num_kv_heads]``, stored as ``[..., num_blocks,
    num_kv_heads, block_size]``: the scales of one KV head's consecutive tokens are then contiguous,
    so a decode tile of keys reads them in a few wide loads (token-major, each token's scale would
    come from a 32-byte sector of its own)."""
    return torch.empty(
        *shape[:-2], shape[-1], shape[-2], dtype=KV_SCALE_DTYPE, device=device
    ).transpose(-1, -2)


def kv_cache_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache tensor: e4m3 for an FP8 cache, else the model's dtype."""
    return FP8_DTYPE if is_fp8_kv_cache(kv_cache_dtype) else model_dtype


class AttentionBackend:
    """Shapes: q ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]``;
    the output has q's shape. ``k_scale``/``v_scale`` are the per-row scales of an FP8 cache (see
    the module docstring), None for a cache in the model's dtype.

    New K/V rows reach the cache before attention by one of two paths (``layer.Attention``): on a
    GPU with a kernel backend, ``kv_store.rope_and_store`` (QK-norm, RoPE and the store in one Triton
    kernel); on the plain reference path, ``store_kvcache`` of the torch backend."""

    name = "base"
    # whether ``decode`` takes ``quantize=True``: the output, whose heads of 128 channels are the
    # 128-channel groups of an FP8 output projection's input, handed to it as ``QuantizedRows``
    # (``quantization/fp8.py``; rows padded as ``fp8_fused`` pads them), as the unfused
    # ``quantize_activation_groups`` of the output in the model's dtype would give
    quantizes_output = False

    def store_kvcache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Write each new token's K/V row into its cache slot (quantized, with its scales, for an
        FP8 cache); slot -1 is skipped. Only the torch backend takes this path: the kernel backends
        store through ``kv_store.rope_and_store``."""
        raise NotImplementedError(
            f"attention backend {self.name!r} stores K/V through kv_store.rope_and_store"
        )

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context: Context,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention over variable-length sequences. Without ``context.block_tables`` the
        keys are ``k``/``v`` themselves; with them, each sequence's keys (cached prefix and the new
        tokens, already stored) are read from the paged cache."""
        raise NotImplementedError

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context: Context,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query per sequence over its ``context.context_lens`` cached tokens."""
        raise NotImplementedError
