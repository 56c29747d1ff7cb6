"""The attention layer and the one interface its backends implement.

KV-cache layout (owned by the model runner): one tensor ``[2, num_layers, num_blocks, block_size,
num_kv_heads, head_dim]``; each layer sees ``k_cache``/``v_cache`` views of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token slot ``s`` lives at block
``s // block_size``, offset ``s % block_size``.
"""
import torch
from torch import nn

from nanovllm.utils.context import Context, get_context

BACKENDS = ("flash-attn", "triton", "torch")


class AttentionBackend:
    """Shapes: q ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]``;
    the output has q's shape."""

    name = "base"

    def store_kvcache(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write each new token's K/V row into its cache slot; slot -1 is skipped."""
        raise NotImplementedError

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context, scale: float,
    ) -> torch.Tensor:
        """Causal attention over variable-length sequences. Without ``context.block_tables`` the
        keys are ``k``/``v`` themselves; with them, each sequence's keys (cached prefix and the new
        tokens, already stored) are read from the paged cache."""
        raise NotImplementedError

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context, scale: float
    ) -> torch.Tensor:
        """One query per sequence over its ``context.context_lens`` cached tokens."""
        raise NotImplementedError


def resolve_backend_name(name: str, device: str, block_size: int) -> str:
    """"auto" is flash-attn when importable on GPU, else the Triton kernels on GPU, torch on CPU."""
    if name == "auto":
        if device == "cpu":
            return "torch"
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return "triton"
        return "flash-attn" if block_size % 256 == 0 else "triton"
    if name != "torch" and device == "cpu":
        raise ValueError(f"attention_backend {name!r} needs a CUDA GPU; on the CPU use 'torch' or 'auto'")
    if name == "flash-attn" and block_size % 256:
        raise ValueError(
            f"attention_backend 'flash-attn' needs kvcache_block_size to be a multiple of 256, got {block_size}"
        )
    return name


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
    ``k_cache``, ``v_cache`` and ``backend`` once the cache exists."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_context()
        if self.k_cache.numel():
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping)
        if context.is_prefill:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, context, self.scale)
        return self.backend.decode(q, self.k_cache, self.v_cache, context, self.scale)
