"""The Llama-family decoder; Qwen2 and Qwen3 change its attention options."""

import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from nanovllm.models.config import head_dim
from nanovllm.parallel.distributed import get_tp_size

__all__ = ["LlamaForCausalLM", "head_dim"]


def make_norm(config, quant_config, quantize: bool, reduces_input: bool) -> nn.Module:
    if quantize:
        return quant_config.norm(config.hidden_size, config.rms_norm_eps, reduces_input)
    if reduces_input:
        from nanovllm.parallel.reduce_norm import ReduceAddRMSNorm  # tensor parallelism only

        return ReduceAddRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DecoderAttention(nn.Module):
    def __init__(self, config, qkv_bias, o_bias, qk_norm: bool, quant_config, reduce_results):
        super().__init__()
        tp_size = get_tp_size()
        hd = head_dim(config)
        linear = quant_config.linear_method() if quant_config else None
        self.quantized_input = quant_config is not None  # qkv_proj reads quantized rows
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        hidden = config.hidden_size
        self.qkv_proj = QKVParallelLinear(hidden, hd, heads, kv_heads, qkv_bias, linear)
        self.o_proj = RowParallelLinear(heads * hd, hidden, o_bias, linear, reduce_results)
        theta, scaling = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(hd, config.max_position_embeddings, theta, scaling)
        quantize = quant_config is not None and quant_config.quantizes_attention_output(hd)
        self.attn = Attention(heads // tp_size, hd, hd**-0.5, max(1, kv_heads // tp_size), quantize)
        if qk_norm:
            self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps)
        self.qk_norm = qk_norm

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
        return self.o_proj(self.attn(qkv, positions, self.rotary_emb.cos_sin_cache, norm))


class GatedMLP(nn.Module):
    def __init__(
        self, hidden, inter, hidden_act, bias=False, quant_config=None, reduce_results=True
    ):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        linear = quant_config.linear_method() if quant_config else None
        self.quantized_input = quant_config is not None  # gate_up_proj reads quantized rows
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter] * 2, bias, linear)
        self.down_proj = RowParallelLinear(inter, hidden, bias, linear, reduce_results)
        self.act_fn = quant_config.activation() if quant_config else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module, quant_config, reduces_input):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        # an FP8 linear takes its input quantized by the norm in front (a MoE block routes bf16)
        quantize = (getattr(m, "quantized_input", False) for m in (self_attn, mlp))
        norm_args = (config, quant_config)
        self.input_layernorm = make_norm(*norm_args, next(quantize), reduces_input)
        self.post_attention_layernorm = make_norm(*norm_args, next(quantize), reduces_input)

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
    def __init__(self, config, layers: list[nn.Module], reduces_input: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = make_norm(config, None, False, reduces_input)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama 3.x; subclasses change the attention options and each layer's MLP."""

    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False

    def attention_biases(self, config) -> tuple[bool, bool]:  # q/k/v, output
        bias = getattr(config, "attention_bias", False)
        return bias, bias

    def make_mlp(self, config, layer_idx: int, quant_config, reduce_results: bool) -> nn.Module:
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        return GatedMLP(hidden, inter, config.hidden_act, bias, quant_config, reduce_results)

    def __init__(self, config, quant_config=None):
        super().__init__()
        qkv_bias, o_bias = self.attention_biases(config)
        # under tensor parallelism each row-parallel output is summed by the norm behind it
        # (parallel/reduce_norm.py), unless a bias must be added after the sum
        mlp_bias = getattr(config, "mlp_bias", False)
        defer = get_tp_size() > 1 and not (o_bias or mlp_bias)
        layers = [
            DecoderLayer(
                config,
                DecoderAttention(config, qkv_bias, o_bias, self.qk_norm, quant_config, not defer),
                self.make_mlp(config, i, quant_config, not defer),
                quant_config,
                defer,
            )
            for i in range(config.num_hidden_layers)
        ]
        self.model = DecoderModel(config, layers, defer)
        if get_tp_size() == 1 and quant_config is None and not (o_bias or mlp_bias):
            for layer in layers:  # the norm behind adds up a split few-rows GEMM's K ranges
                layer.self_attn.o_proj.leaves_ranges = True
                if isinstance(layer.mlp, GatedMLP):
                    layer.mlp.down_proj.leaves_ranges = True
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor, out=None, gather: bool = True):
        return self.lm_head(hidden_states, out, gather)
