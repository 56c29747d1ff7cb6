"""Qwen3 dense models, built from the tensor-parallel layers. Every constant comes from the
checkpoint's config."""
import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding, apply_qk_norm_rotary_emb
from nanovllm.utils.distributed import get_tp_size


def rope_theta(config) -> float:
    """RoPE base from ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x). Only plain
    RoPE is supported: a scaled variant is rejected rather than silently run unscaled."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (only plain RoPE)")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config has no rope_theta (neither in rope_parameters nor at top level)")
    return float(theta)


def head_dim(config) -> int:
    """``head_dim`` from the config when present (Qwen3 sets it explicitly), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Qwen3Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        tp_size = get_tp_size()
        self.head_dim = head_dim(config)
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=bias
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope_theta(config))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_qk_norm_rotary_emb(
            positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.rotary_emb.cos_sin_cache
        )
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1, -1))


class Qwen3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config):
        super().__init__()
        self.model = Qwen3Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)
