"""Random checkpoints of named model shapes (Hugging Face layout, bundled Qwen3 tokenizer)."""

import json
import math
import os
import shutil

import torch
from safetensors.torch import save_file
from torch import nn

from nanovllm.utils.hybrid_shapes import HYBRID_SHAPES

TOKENIZER_DIR = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "assets", "qwen3-tokenizer"
)
QWEN3_VOCAB_SIZE = 151936

LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

# the config.json of each architecture, before a shape's values
BASES = {
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=QWEN3_VOCAB_SIZE,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        attention_bias=False,
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=QWEN3_VOCAB_SIZE,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        attention_bias=False,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=QWEN3_VOCAB_SIZE,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        use_sliding_window=False,
    ),
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        attention_bias=False,
        mlp_bias=False,
    ),
}


def _shape(model_type, layers, hidden, inter, heads, kv_heads, head_dim, tied, **extra) -> dict:
    shape = dict(
        model_type=model_type,
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        **extra,
    )
    return shape if head_dim is None else dict(shape, head_dim=head_dim)


SHAPES = {
    # a few MB: fast on any CPU, with the real vocabulary so any text tokenizes
    "tiny": _shape("qwen3", 2, 64, 128, 4, 2, 32, True),
    "qwen3-0.6b": _shape("qwen3", 28, 1024, 3072, 16, 8, 128, True),
    "qwen3-4b": _shape("qwen3", 36, 2560, 9728, 32, 8, 128, False),
    "qwen3-8b": _shape("qwen3", 36, 4096, 12288, 32, 8, 128, False),
    "qwen3-30b-a3b": _shape(
        "qwen3_moe",
        48,
        2048,
        6144,
        32,
        4,
        128,
        False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    "qwen2.5-0.5b": _shape("qwen2", 24, 896, 4864, 14, 2, None, True),
    "llama3.2-1b": _shape("llama", 16, 2048, 8192, 32, 8, 64, True),
}
# config.json's quantization_config of Qwen's FP8 checkpoints (Qwen3-8B-FP8, Qwen3-30B-A3B-FP8)
FP8_QUANTIZATION_CONFIG = dict(
    quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128]
)
COMMON = dict(
    rms_norm_eps=1e-6,
    hidden_act="silu",
    bos_token_id=151643,
    eos_token_id=151645,
    torch_dtype="bfloat16",
)


def model_config(shape: str = "qwen3-0.6b", **overrides) -> dict:
    """``config.json`` as a dict: ``shape`` on its architecture's base, then ``overrides``."""
    if shape in HYBRID_SHAPES:
        return dict(HYBRID_SHAPES[shape], **overrides)
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    values = dict(SHAPES[shape])
    config = dict(COMMON, **BASES[values.pop("model_type")], **values)
    config.update(overrides)
    return config


def weight_bytes(config: dict, itemsize: int = 2, quantization: str | None = None) -> int:
    return sum(tensor_bytes(config, itemsize, quantization).values())


def tensor_bytes(
    config: dict, itemsize: int = 2, quantization: str | None = None
) -> dict[str, int]:
    """Tensor name -> bytes; FP8 weights take 1 byte a value plus their scales."""
    sizes = {}
    for name, shape in weight_shapes(config).items():
        if quantization == "fp8" and is_quantized_weight(name):
            sizes[name] = math.prod(shape) + 4 * math.prod(scale_shape(shape))
        else:
            sizes[name] = math.prod(shape) * itemsize
    return sizes


def is_quantized_weight(name: str) -> bool:
    """The decoder layers' projections; embeddings, norms, routers and the LM head stay float."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-n // 128) for n in shape)


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, by the architecture's checkpoint names."""
    hidden, model_type = config["hidden_size"], config["model_type"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (
            hidden,
        )
        for name, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (size, hidden)
            if model_type == "qwen2" or config.get("attention_bias"):
                shapes[p + f"self_attn.{name}_proj.bias"] = (size,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_size)
        if config.get("attention_bias"):
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if model_type in ("qwen3", "qwen3_moe"):
            shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (
                head_dim,
            )
        if model_type == "qwen3_moe" and _is_sparse(config, i):
            inter = config["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (config["num_experts"], hidden)
            for e in range(config["num_experts"]):
                expert = p + f"mlp.experts.{e}."
                shapes[expert + "gate_proj.weight"] = (inter, hidden)
                shapes[expert + "up_proj.weight"] = (inter, hidden)
                shapes[expert + "down_proj.weight"] = (hidden, inter)
        else:
            inter = config["intermediate_size"]
            shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
            if config.get("mlp_bias"):
                shapes[p + "mlp.gate_proj.bias"] = shapes[p + "mlp.up_proj.bias"] = (inter,)
                shapes[p + "mlp.down_proj.bias"] = (hidden,)
    return shapes


def _is_sparse(config: dict, layer_idx: int) -> bool:
    # Qwen3-MoE's rule, as models/qwen3_moe.py
    step = config.get("decoder_sparse_step") or 1
    return (
        layer_idx not in (config.get("mlp_only_layers") or [])
        and config["num_experts"] > 0
        and (layer_idx + 1) % step == 0
    )


def random_weights(
    config: dict, dtype: torch.dtype, seed: int = 0, std: float = 0.02
) -> dict[str, torch.Tensor]:
    """N(0, std) matrices and biases, norm weights 1 + N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = (1 + 0.1 * torch.randn(*shape, generator=g)).to(dtype)
        else:
            weights[name] = (torch.randn(*shape, generator=g) * std).to(dtype)
    return weights


def quantize_checkpoint(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen's FP8 format: quantized weights as e4m3 with their ``weight_scale_inv``."""
    from nanovllm.quantization.fp8 import quantize_weight_blocks

    out = {}
    for name, tensor in weights.items():
        if is_quantized_weight(name):
            out[name], out[name + "_scale_inv"] = quantize_weight_blocks(tensor)
        else:
            out[name] = tensor
    return out


def make_random_checkpoint(
    path: str,
    shape: str = "tiny",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = 0.02,
    weights: bool = True,
    quantization: str | None = None,
    **overrides,
) -> str:
    """Write config.json, model.safetensors (not without ``weights``: for load_format="dummy") and
    the tokenizer and generation config into ``path``; ``quantization="fp8"``: Qwen's format."""
    if shape not in SHAPES and shape not in HYBRID_SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES | HYBRID_SHAPES)}, got {shape!r}")
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    config = model_config(shape, torch_dtype=str(dtype).removeprefix("torch."), **overrides)
    if quantization == "fp8":
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if weights and shape not in HYBRID_SHAPES:  # those: load_format="dummy"
        tensors = random_weights(config, dtype, seed, std)
        if quantization == "fp8":
            tensors = quantize_checkpoint(tensors)
        save_file(tensors, os.path.join(path, "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), os.path.join(path, name))
    return path


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """``load_format="dummy"``: norms 1, biases 0, the rest N(0, std), the same on every rank."""
    generators = {}
    params = dict(model.named_parameters())
    for name, param in params.items():
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        if getattr(param, "derived", False):
            continue  # set with its weight
        if param.dtype == torch.float8_e4m3fn:
            from nanovllm.quantization.fp8 import quantize_weight_blocks

            drawn = torch.empty(param.shape, dtype=torch.float32, device=device)
            q, scale = quantize_weight_blocks(drawn.normal_(0.0, std, generator=generators[device]))
            param.data.copy_(q)
            params[name + "_scale_inv"].data.copy_(scale)
        elif name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, std, generator=generators[device])
