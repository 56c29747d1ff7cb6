import torch
from torch import nn

from nanovllm.layers.layernorm import rms_norm
from nanovllm.utils.compile import compile_on_gpu


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@compile_on_gpu
def apply_rotary_emb(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE in float32. q/k: [num_tokens, num_heads, head_dim];
    cos_sin_cache: [max_position, 1, head_dim] holding [cos | sin]."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [num_tokens, 1, head_dim // 2] each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@compile_on_gpu
def apply_qk_norm_rotary_emb(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    eps: float, cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (Qwen3's QK-norm), then RoPE: the same arithmetic as
    ``RMSNorm`` followed by ``apply_rotary_emb``, compiled as one function on the GPU so the
    four passes become one."""
    q = rms_norm.__wrapped__(q, q_weight, eps)
    k = rms_norm.__wrapped__(k, k_weight, eps)
    return apply_rotary_emb.__wrapped__(positions, q, k, cos_sin_cache)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).unsqueeze(1)  # [max_position, 1, head_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_emb(positions, query, key, self.cos_sin_cache)
