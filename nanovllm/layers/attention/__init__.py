"""Attention: the backend interface, the selector, the layer, and the backends below them."""

from nanovllm.layers.attention.interface import AttentionBackend, is_fp8_kv_cache
from nanovllm.layers.attention.layer import Attention
from nanovllm.layers.attention.selector import BACKENDS, get_attention_backend, resolve_backend_name

__all__ = [
    "BACKENDS",
    "Attention",
    "AttentionBackend",
    "get_attention_backend",
    "is_fp8_kv_cache",
    "resolve_backend_name",
]
