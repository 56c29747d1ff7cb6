"""The one place that picks an attention backend and creates it (importing it only then)."""

import torch

from nanovllm.layers.attention.interface import AttentionBackend

BACKENDS = ("flash-attn", "triton", "torch")


def resolve_backend_name(
    name: str,
    device: str,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    weight_quantization: str | None = None,
) -> str:
    """The backend that runs, or a ValueError. "auto": torch on the CPU; on a GPU flash-attn
    where it can run (2-byte dtype, no FP8, block size % 256 == 0), else Triton (gpu_selector)."""
    if device == "cuda" or name == "flash-attn":  # which refuses an FP8 cache on any device
        from nanovllm.layers.attention.gpu_selector import resolve_gpu_backend

        args = (block_size, dtype, kv_cache_dtype, weight_quantization)
        return resolve_gpu_backend(name, device, *args)
    if name not in ("auto", "torch"):
        msg = "needs a CUDA GPU; on the CPU use 'torch' or 'auto'"
        raise ValueError(f"attention_backend {name!r} {msg}")
    return "torch"


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from nanovllm.layers.attention.reference import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from nanovllm.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash-attn":
        from nanovllm.layers.attention.flash import FlashAttentionBackend

        return FlashAttentionBackend()
    allowed = ", ".join(map(repr, BACKENDS))
    raise ValueError(f"attention_backend must be one of {allowed}, got {name!r}")
