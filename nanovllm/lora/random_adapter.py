"""Random LoRA adapters in PEFT's format, for benchmarks, tests and examples."""

import json
import os

import torch

from nanovllm.lora.adapter import ATTENTION, CONFIG_FILE, MLP, WEIGHTS_FILE, module_shapes


def random_adapter(hf_config, rank: int = 16, seed: int = 0, std: float = 0.02, targets=None):
    """``(tensors, peft_config)``: PEFT's tensor names, A and B drawn N(0, std), lora_alpha = r."""
    targets = list(targets or ATTENTION + MLP)
    generator = torch.Generator().manual_seed(seed)
    shapes, tensors = module_shapes(hf_config), {}
    for layer in range(hf_config.num_hidden_layers):
        for module in targets:
            n_in, n_out = shapes[module]
            part = "self_attn" if module in ATTENTION else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            for kind, shape in (("A", (rank, n_in)), ("B", (n_out, rank))):
                drawn = torch.randn(shape, generator=generator) * std
                tensors[f"{name}.lora_{kind}.weight"] = drawn
    config = dict(peft_type="LORA", r=rank, lora_alpha=rank, target_modules=targets, bias="none")
    return tensors, config


def save_random_adapter(path: str, hf_config, **kwargs) -> str:
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) at ``path``."""
    from safetensors.torch import save_file

    tensors, config = random_adapter(hf_config, **kwargs)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    save_file(
        {k: v.to(torch.bfloat16) for k, v in tensors.items()}, os.path.join(path, WEIGHTS_FILE)
    )
    return path
