"""The dense decoder of the Llama family (Llama 3.x), built from the tensor-parallel layers; Qwen2 and
Qwen3 are the same decoder with other attention options (``models/qwen2.py``, ``models/qwen3.py``).
Every constant comes from the checkpoint's config."""

import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import (
    RotaryEmbedding,
    apply_qk_norm_rotary_emb,
    rope_parameters,
)
from nanovllm.parallel.distributed import get_tp_size
from nanovllm.quantization.fp8 import BLOCK, QuantizedRows


def head_dim(config) -> int:
    """``head_dim`` from the config when present (Qwen3 sets it explicitly), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    """Self-attention with RoPE. ``qkv_bias``/``o_bias``: biases on the q/k/v and the output
    projections; ``qk_norm``: per-head RMSNorm of q and k before RoPE (Qwen3)."""

    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        tp_size = get_tp_size()
        self.head_dim = head_dim(config)
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias
        )
        self.quantized_input = self.qkv_proj.fp8  # the norm in front hands qkv_proj quantized rows
        theta, scaling = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, theta, scaling
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)
        self.attn.quantize_output = (
            self.o_proj.fp8 and self.head_dim == BLOCK
        )  # a head: one group of o_proj's input
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.qk_norm = qk_norm

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        if self.attn.fuses_rope(qkv):
            norm = (
                (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
            )
            o = self.attn.rope_store_attend(qkv, positions, self.rotary_emb.cos_sin_cache, norm)
            return self._project(o)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = apply_qk_norm_rotary_emb(
                positions,
                q,
                k,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.eps,
                self.rotary_emb.cos_sin_cache,
            )
        else:
            q, k = self.rotary_emb(positions, q, k)
        return self._project(self.attn(q, k, v))

    def leave_output_unsummed(self) -> None:
        self.o_proj.reduce_results = False

    def _project(self, o: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """o_proj of the attention output [tokens, heads, head_dim] (or of its quantized rows)."""
        return self.o_proj(o if isinstance(o, QuantizedRows) else o.flatten(1, -1))


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up as one column-parallel GEMM."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False
    ):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul(quantize=self.down_proj.fp8)
        self.quantized_input = self.gate_up_proj.fp8

    def leave_output_unsummed(self) -> None:
        self.down_proj.reduce_results = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        # FP8 layers take their input quantized by the norm in front (MoE blocks route bf16 rows)
        quantize = (
            getattr(self_attn, "quantized_input", False),
            getattr(mlp, "quantized_input", False),
        )
        self.input_layernorm = RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, quantize=quantize[0]
        )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, quantize=quantize[1]
        )

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


class DecoderModel(nn.Module):
    def __init__(self, config, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        biased = any(
            isinstance(m, RowParallelLinear) and m.bias is not None for m in self.modules()
        )
        if get_tp_size() > 1 and not biased:
            # each layer's attention and MLP leave their sums to the norm behind them (layers/reduce_norm.py):
            # the next one's, the last layer's to the final norm (layer 0's input norm gets no residual)
            for layer in self.layers:
                layer.self_attn.leave_output_unsummed()
                layer.mlp.leave_output_unsummed()
                layer.input_layernorm.reduces_input = (
                    layer.post_attention_layernorm.reduces_input
                ) = True
            self.norm.reduces_input = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama 3.0/3.1/3.2: no q/k norm, ``attention_bias`` on all four projections, ``mlp_bias`` on
    the MLP, the ``llama3`` RoPE scaling, a tied or untied head. Subclasses change the attention
    options and the MLP of each layer."""

    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False

    def attention_biases(self, config) -> tuple[bool, bool]:
        """(q/k/v bias, output bias)"""
        bias = getattr(config, "attention_bias", False)
        return bias, bias

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=getattr(config, "mlp_bias", False),
        )

    def __init__(self, config):
        super().__init__()
        qkv_bias, o_bias = self.attention_biases(config)
        layers = [
            DecoderLayer(
                config,
                DecoderAttention(config, qkv_bias, o_bias, self.qk_norm),
                self.make_mlp(config, i),
            )
            for i in range(config.num_hidden_layers)
        ]
        self.model = DecoderModel(config, layers)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(
        self, hidden_states: torch.Tensor, out: torch.Tensor | None = None, gather: bool = True
    ) -> torch.Tensor | None:
        return self.lm_head(hidden_states, out, gather)
