"""vLLM's module path for ``AsyncLLM`` (nanovllm/entrypoints/async_llm.py)."""

from nanovllm.entrypoints.async_llm import AsyncLLM, RetryableRequestError

__all__ = ["AsyncLLM", "RetryableRequestError"]
