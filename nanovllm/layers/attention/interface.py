"""The attention layer, the one interface its backends implement, and the one place that picks a
backend.

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
from torch import nn

from nanovllm.utils.context import Context, get_context

BACKENDS = ("flash-attn", "triton", "torch")

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
    return torch.empty(*shape[:-2], shape[-1], shape[-2], dtype=KV_SCALE_DTYPE, device=device).transpose(-1, -2)


def kv_cache_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache tensor: e4m3 for an FP8 cache, else the model's dtype."""
    return FP8_DTYPE if is_fp8_kv_cache(kv_cache_dtype) else model_dtype


class AttentionBackend:
    """Shapes: q ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]``;
    the output has q's shape. ``k_scale``/``v_scale`` are the per-row scales of an FP8 cache (see
    the module docstring), None for a cache in the model's dtype."""

    name = "base"

    def store_kvcache(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> None:
        """Write each new token's K/V row into its cache slot (quantized, with its scales, for an
        FP8 cache); slot -1 is skipped."""
        raise NotImplementedError

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context, scale: float,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention over variable-length sequences. Without ``context.block_tables`` the
        keys are ``k``/``v`` themselves; with them, each sequence's keys (cached prefix and the new
        tokens, already stored) are read from the paged cache."""
        raise NotImplementedError

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context, scale: float,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query per sequence over its ``context.context_lens`` cached tokens."""
        raise NotImplementedError


def resolve_backend_name(
    name: str, device: str, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> str:
    """Which backend runs: the one place that decides, called by ``Config`` (to reject a bad
    combination before anything starts) and by the model runner.

    "auto" is torch on CPU; on GPU it is flash-attn when importable and able to run (a 2-byte
    ``dtype``, a cache in the model's dtype, ``block_size`` a multiple of 256), else the Triton
    kernels. flash-attn takes neither float32 nor an FP8 cache; the Triton kernels read e4m3 only
    on GPUs of compute capability 8.9 or newer."""
    fp8 = is_fp8_kv_cache(kv_cache_dtype)
    if name == "flash-attn" and fp8:
        raise ValueError(
            f"attention_backend 'flash-attn' cannot read an FP8 KV cache (kv_cache_dtype {kv_cache_dtype!r}); "
            "use attention_backend 'triton' or 'auto', or kv_cache_dtype 'auto'"
        )
    if name not in ("auto", "torch") and device == "cpu":
        raise ValueError(f"attention_backend {name!r} needs a CUDA GPU; on the CPU use 'torch' or 'auto'")
    if name == "auto":
        if device == "cpu":
            return "torch"
        name = "triton" if fp8 or dtype == torch.float32 else _flash_attn_or_triton(block_size)
    if name == "flash-attn":
        if dtype == torch.float32:
            raise ValueError(
                "attention_backend 'flash-attn' does not take dtype float32; use dtype 'bfloat16' or 'float16', "
                "or attention_backend 'triton' or 'auto'"
            )
        if block_size % 256:
            raise ValueError(
                f"attention_backend 'flash-attn' needs kvcache_block_size to be a multiple of 256, got {block_size}"
            )
    if name == "triton" and fp8 and device == "cuda":
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} with attention_backend 'triton' needs a GPU of compute "
                f"capability 8.9 or newer (e4m3 support), this one is {capability[0]}.{capability[1]}; "
                "use kv_cache_dtype 'auto'"
            )
    return name


def _flash_attn_or_triton(block_size: int) -> str:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "triton"
    return "flash-attn" if block_size % 256 == 0 else "triton"


def get_attention_backend(name: str) -> AttentionBackend:
    """Create a backend by name, importing its heavy dependency only now."""
    if name == "torch":
        from nanovllm.layers.attention_torch import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from nanovllm.layers.attention_triton import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash-attn":
        from nanovllm.layers.attention_flash import FlashAttentionBackend

        return FlashAttentionBackend()
    raise ValueError(f"attention_backend must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")


class Attention(nn.Module):
    """Stores this step's K/V in the paged cache, then attends. The model runner sets
    ``k_cache``, ``v_cache`` (and for an FP8 cache ``k_scale``, ``v_scale``) and ``backend`` once
    the cache exists."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_context()
        if self.k_cache.numel():
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping, self.k_scale, self.v_scale)
        return self._attend(q, k, v, context)

    def fuses_rope(self, x: torch.Tensor) -> bool:
        """Whether ``rope_store_attend`` takes ``x``'s step: on a GPU, for the kernel backends (the
        torch backend stays the plain reference path)."""
        return x.is_cuda and self.backend.name != "torch"

    def rope_store_attend(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                          norm: tuple[torch.Tensor, torch.Tensor, float] | None) -> torch.Tensor:
        """``forward`` from the fused projection: QK-norm (``norm``), RoPE and the cache store in
        one kernel (``kv_store.rope_and_store``), then attention."""
        from nanovllm.layers.kv_store import rope_and_store

        context = get_context()
        q, k, v = rope_and_store(
            qkv, positions, self.num_heads, self.num_kv_heads, cos_sin_cache, norm, self.k_cache, self.v_cache,
            context.slot_mapping, self.k_scale, self.v_scale, write_k=context.is_prefill,
        )
        return self._attend(q, k, v, context)

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor, context: Context) -> torch.Tensor:
        scales = (self.k_scale, self.v_scale)
        if context.is_prefill:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, context, self.scale, *scales)
        return self.backend.decode(q, self.k_cache, self.v_cache, context, self.scale, *scales)
