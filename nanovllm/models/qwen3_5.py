"""Qwen3.5's hybrid text model: Gated DeltaNet layers and gated full-attention layers, chosen per
layer by ``config.layer_types``; every RMSNorm but the DeltaNet's gated one scales by 1 + weight."""

import torch
from torch import nn

from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import QKVParallelLinear, RowParallelLinear
from nanovllm.layers.linear_attention.layer import GatedDeltaNet
from nanovllm.models.config import head_dim
from nanovllm.models.llama import GatedMLP, LlamaForCausalLM
from nanovllm.parallel.distributed import get_tp_size
from nanovllm.utils.loader import packed_target

LAYER_TYPES = ("linear_attention", "full_attention")
# a multimodal checkpoint whose language model runs alone -> the text architecture that runs it
MULTIMODAL = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
SKIPPED_PREFIXES = ("model.visual.", "mtp.")  # the vision tower, the multi-token-prediction head


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 times (1 + weight), rounded to x's dtype once at the end."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


class ZeroCentredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centred_rms_norm(x, self.weight, self.eps)


def partial_rotary(config) -> tuple[float, int]:
    """(theta, rotary dims per head) from ``rope_parameters``; only the default type runs."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config has no rope_theta (in rope_parameters or at top level)")
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    dim = int(head_dim(config) * factor)
    if dim < 2 or dim % 2 or dim > head_dim(config):
        msg = f"allowed: an even number of dims in 2..{head_dim(config)}"
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotary dims; {msg}")
    return float(theta), dim


class GatedAttention(nn.Module):
    """q_proj gives each head [query | gate]; QK-norm, RoPE on the first ``rotary_dim`` dims,
    attention through ``Attention`` (its own RoPE the identity), times sigmoid(gate), o_proj."""

    def __init__(self, config):
        super().__init__()
        tp_size = get_tp_size()
        hd = self.head_dim = head_dim(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % tp_size:
            msg = f"allowed: a multiple of tensor_parallel_size {tp_size}"
            raise ValueError(f"num_attention_heads is {heads}; {msg}")
        self.num_heads, self.num_kv_heads = heads // tp_size, max(1, kv_heads // tp_size)
        bias = getattr(config, "attention_bias", False)
        # twice the query heads: [query | gate] per head, as q_proj stores them
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, 2 * heads, kv_heads, bias)
        self.o_proj = RowParallelLinear(heads * hd, config.hidden_size, bias)
        self.q_norm = ZeroCentredRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, config.rms_norm_eps)
        theta, self.rotary_dim = partial_rotary(config)
        steps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        self.register_buffer("inv_freq", 1.0 / theta**steps, persistent=False)
        # one position of [cos 1 | sin 0]: Attention's RoPE leaves q and k as they are
        identity = torch.cat([torch.ones(hd // 2), torch.zeros(hd // 2)]).float()
        self.register_buffer("identity_cos_sin", identity.view(1, 1, hd), persistent=False)
        self.attn = Attention(self.num_heads, hd, hd**-0.5, self.num_kv_heads)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE in float32 on the first ``rotary_dim`` dims of x [T, heads, hd]."""
        freqs = positions.float()[:, None] * self.inv_freq.float()  # [T, rotary_dim // 2]
        cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
        rot, rest = x[..., : self.rotary_dim].float(), x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((rot, rest), dim=-1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t, hd = hidden.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * 2 * hd, self.num_kv_heads * hd
        qg, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * hd).chunk(2, dim=-1)
        q = self.rotate(positions, self.q_norm(q))
        k = self.rotate(positions, self.k_norm(k.view(t, self.num_kv_heads, hd)))
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v), dim=-1)
        out = self.attn(qkv, torch.zeros_like(positions), self.identity_cos_sin, None)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class Qwen3_5DecoderLayer(nn.Module):
    """``mixer`` (GatedDeltaNet as ``linear_attn``, GatedAttention as ``self_attn``), then ``mlp``,
    each behind a zero-centred RMSNorm and added to the residual."""

    def __init__(self, config, layer_type: str, mixer: nn.Module, mlp: nn.Module):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = ZeroCentredRMSNorm(hidden, eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        if self.layer_type == "linear_attention":
            x = self.linear_attn(x)
        else:
            x = self.self_attn(positions, x)
        hidden = hidden + x
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def layer_types(config) -> list[str]:
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers or any(t not in LAYER_TYPES for t in types):
        msg = f"allowed: {config.num_hidden_layers} entries, each one of {LAYER_TYPES}"
        raise ValueError(f"layer_types is {types!r}; {msg}")
    return types


class Qwen3_5TextModel(nn.Module):
    def __init__(self, config, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5's text model with Hugging Face's ``Qwen3_5ForCausalLM`` weight names, or a
    ``Qwen3_5ForConditionalGeneration`` checkpoint's language model (``language_config``).
    Full-attention layers hold ``Attention`` modules (the KV cache); linear ones
    ``GatedDeltaNet`` (the states). Subclasses change ``linear_attention`` and ``make_mlp``."""

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    linear_attention = GatedDeltaNet

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def __init__(self, config, quant_config=None):
        super().__init__()
        if quant_config is not None:
            msg = f"quantization is not supported for {type(self).__name__} (only None)"
            raise ValueError(msg)
        layers = []
        for i, kind in enumerate(layer_types(config)):
            if kind == "linear_attention":
                mixer = self.linear_attention(config)
            else:
                mixer = GatedAttention(config)
            layers.append(Qwen3_5DecoderLayer(config, kind, mixer, self.make_mlp(config, i)))
        self.model = Qwen3_5TextModel(config, layers)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def map_checkpoint_name(cls, name: str) -> tuple[str | None, tuple]:
        """(parameter, loader arguments); a multimodal checkpoint's ``model.language_model.*`` as
        ``model.*``, its vision tower and multi-token-prediction head skipped (None)."""
        if name.startswith(SKIPPED_PREFIXES):
            return None, ()
        return cls.map_text_name(name.replace("model.language_model.", "model.", 1))

    @classmethod
    def map_text_name(cls, name: str) -> tuple[str, tuple]:
        return packed_target(name, cls.packed_modules_mapping)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor, out=None, gather: bool = True):
        return self.lm_head(hidden_states, out, gather)


def language_config(hf_config):
    """A ``...ForConditionalGeneration`` config (``MULTIMODAL``) as its language model's:
    ``text_config`` with the text architecture and the checkpoint's ``tie_word_embeddings``;
    any other config as it is."""
    names = [
        MULTIMODAL[n] for n in getattr(hf_config, "architectures", None) or [] if n in MULTIMODAL
    ]
    if not names:
        return hf_config
    text = hf_config.text_config
    text.architectures = names[:1]
    text.tie_word_embeddings = getattr(hf_config, "tie_word_embeddings", False)
    return text
