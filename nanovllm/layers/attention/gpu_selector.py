"""The attention backend on a GPU: flash-attn where it can run, else the Triton kernels."""

import torch

from nanovllm.layers.attention.interface import is_fp8_kv_cache


def resolve_gpu_backend(
    name: str, device: str, block_size: int, dtype: torch.dtype, kv_cache_dtype: str, quantization
) -> str:
    fp8 = is_fp8_kv_cache(kv_cache_dtype)
    if name == "flash-attn" and fp8:
        raise ValueError(
            "attention_backend 'flash-attn' cannot read an FP8 KV cache (kv_cache_dtype "
            f"{kv_cache_dtype!r}); use attention_backend 'triton' or 'auto', or kv_cache_dtype "
            "'auto'"
        )
    if device != "cuda":
        msg = "needs a CUDA GPU; on the CPU use 'torch' or 'auto'"
        raise ValueError(f"attention_backend {name!r} {msg}")
    if name == "auto":
        triton_only = fp8 or dtype == torch.float32 or quantization == "fp8"
        name = "triton" if triton_only else _flash_attn_or_triton(block_size)
    if name == "flash-attn" and dtype == torch.float32:
        raise ValueError(
            "attention_backend 'flash-attn' does not take dtype float32; use dtype 'bfloat16' "
            "or 'float16', or attention_backend 'triton' or 'auto'"
        )
    if name == "flash-attn" and block_size % 256:
        msg = f"needs kvcache_block_size to be a multiple of 256, got {block_size}"
        raise ValueError(f"attention_backend 'flash-attn' {msg}")
    if name == "triton" and fp8:
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} with attention_backend 'triton' needs a GPU of "
                "compute capability 8.9 or newer (e4m3 support), this one is "
                f"{capability[0]}.{capability[1]}; use kv_cache_dtype 'auto'"
            )
    return name


def _flash_attn_or_triton(block_size: int) -> str:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "triton"
    return "flash-attn" if block_size % 256 == 0 else "triton"
