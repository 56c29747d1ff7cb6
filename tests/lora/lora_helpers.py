"""Tiny base models of three architectures, random PEFT adapters for them, and PEFT's own greedy
loop as the reference (float32, full recompute each token)."""

import os

import torch
from hf_reference import random_prompts

from nanovllm.utils.checkpoint import make_random_checkpoint

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIZES = dict(vocab_size=512, num_hidden_layers=2, hidden_size=64, intermediate_size=128)
SIZES |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
ARCHES = {  # name: (checkpoint shape, its overrides)
    "qwen3": ("tiny", dict(head_dim=32)),
    "qwen2": ("qwen2.5-0.5b", {}),
    "llama": ("llama3.2-1b", dict(head_dim=16)),
}


def build_base(path: str, arch: str, seed: int = 0) -> str:
    shape, extra = ARCHES[arch]
    overrides = dict(SIZES, eos_token_id=513, bos_token_id=0, **extra)
    return make_random_checkpoint(path, shape, torch.float32, seed=seed, std=0.3, **overrides)


def peft_model(base: str, seed: int, targets=ALL_TARGETS, r: int = 8, alpha: int = 16, **kw):
    """A PEFT model of ``base`` with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **kw)
    model = get_peft_model(model, config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


def save_adapter(model, path: str) -> str:
    model.save_pretrained(path)
    return path


def adapter_tensors(model) -> tuple[dict, dict]:
    """What a training loop hands over: PEFT's tensor names and its config as a dict."""
    from peft import get_peft_model_state_dict

    config = model.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return tensors, config


def prompts(seed: int = 3) -> list[list[int]]:
    """Lengths whose 8 new tokens cross a block boundary (16), and a shared 32-token prefix."""
    out = random_prompts(seed, [10, 14, 27, 40])
    return out + [out[3][:32] + out[0]]


def make_llm(base: str, **kwargs):
    from nanovllm import LLM

    defaults = dict(enable_lora=True, max_loras=4, max_lora_rank=16, kvcache_block_size=16)
    defaults |= dict(num_kvcache_blocks=128, max_model_len=256, device="cpu")
    return LLM(base, **(defaults | kwargs))


def exists(path: str) -> bool:
    return os.path.exists(os.path.join(path, "adapter_model.safetensors"))
