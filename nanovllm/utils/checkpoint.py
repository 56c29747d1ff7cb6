"""Build a randomly initialised Qwen3 checkpoint (Hugging Face layout) with the bundled tokenizer.

For running the whole pipeline without downloaded weights: the text it produces is random, but
throughput and every code path are those of a real model of the same shape.
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file

TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "qwen3-tokenizer")
QWEN3_VOCAB_SIZE = 151936

SHAPES = {
    # a few MB: fast on any CPU, with the real vocabulary so any text tokenizes
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "qwen3-0.6b": dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(num_hidden_layers=36, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def qwen3_config(**overrides) -> dict:
    """A Qwen3 ``config.json`` as a dict: the Qwen3-0.6B values unless overridden."""
    config = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=QWEN3_VOCAB_SIZE,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
        attention_bias=False, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
        **SHAPES["qwen3-0.6b"],
    )
    config.update(overrides)
    return config


def random_weights(config: dict, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random tensors under the checkpoint names of Hugging Face's Qwen3ForCausalLM."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim

    def normal(*shape):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    w = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden), "model.norm.weight": norm(hidden)}
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = normal(q_size, hidden)
        w[p + "self_attn.k_proj.weight"] = normal(kv_size, hidden)
        w[p + "self_attn.v_proj.weight"] = normal(kv_size, hidden)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, q_size)
        w[p + "self_attn.q_norm.weight"] = norm(head_dim)
        w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    return w


def make_random_checkpoint(
    path: str, shape: str = "tiny", dtype: torch.dtype = torch.bfloat16, seed: int = 0, std: float = 0.02, **overrides
) -> str:
    """Write ``config.json``, ``model.safetensors``, the Qwen3 tokenizer files and Qwen3's
    ``generation_config.json`` (its recommended sampling settings) into ``path``."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    config = qwen3_config(**SHAPES[shape], torch_dtype=str(dtype).removeprefix("torch."))
    config.update(overrides)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(random_weights(config, dtype, seed, std), os.path.join(path, "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), os.path.join(path, name))
    return path
