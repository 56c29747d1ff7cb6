"""The FP8 KV cache (``kv_cache_dtype="fp8"``), loaded only for one: each (token, KV head) row
stored as ``x / s`` in e4m3 with ``s = max(max|x| / FP8_MAX, FP8_MIN_SCALE)``, its float32 scales
in a tensor beside the cache (docs/attention.md)."""

import torch

from nanovllm.utils.float8 import FP8_DTYPE, FP8_MAX

__all__ = ["FP8_DTYPE", "FP8_MAX", "FP8_MIN_SCALE", "KV_SCALE_DTYPE", "empty_kv_scales"]

FP8_MIN_SCALE = 2.0**-126  # the smallest normal float32: an all-zero row divides by this, not by 0
KV_SCALE_DTYPE = torch.float32


def empty_kv_scales(*shape: int, device=None) -> torch.Tensor:
    """Scales of shape ``[..., num_blocks, block_size, num_kv_heads]``, stored head-major
    (``[..., num_blocks, num_kv_heads, block_size]``), so the views are not contiguous."""
    return torch.empty(
        *shape[:-2], shape[-1], shape[-2], dtype=KV_SCALE_DTYPE, device=device
    ).transpose(-1, -2)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> e4m3 values [..., head_dim] and float32 scales [...], one a row."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # divide by a tensor: a Python-number divisor may become a multiply by its reciprocal on the
    # GPU, which rounds differently from the Triton store's division
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=FP8_MIN_SCALE)
    return (x / scale.unsqueeze(-1)).to(FP8_DTYPE), scale
