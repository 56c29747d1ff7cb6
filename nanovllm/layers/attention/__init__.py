"""Attention: the interface and the KV-cache layout (``interface``), the backend selector
(``selector``), the layer models use (``layer``), and below them the backends (``reference``: plain
torch, ``triton_backend`` with ``triton_kernels`` and ``triton_decode``, ``flash``) and the Triton
KV store (``kv_store``).
Importing this package imports neither triton nor flash-attn."""

from nanovllm.layers.attention.interface import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_SCALE,
    KV_SCALE_DTYPE,
    AttentionBackend,
    empty_kv_scales,
    is_fp8_kv_cache,
    kv_cache_storage_dtype,
)
from nanovllm.layers.attention.layer import Attention
from nanovllm.layers.attention.selector import BACKENDS, get_attention_backend, resolve_backend_name

__all__ = [
    "BACKENDS",
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_MIN_SCALE",
    "KV_SCALE_DTYPE",
    "Attention",
    "AttentionBackend",
    "empty_kv_scales",
    "get_attention_backend",
    "is_fp8_kv_cache",
    "kv_cache_storage_dtype",
    "resolve_backend_name",
]
