"""Which model class runs a checkpoint: chosen by ``config.json``'s ``architectures``."""

import importlib

# architecture -> (module, class)
ARCHITECTURES = {
    "Qwen3ForCausalLM": ("nanovllm.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("nanovllm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2ForCausalLM": ("nanovllm.models.qwen2", "Qwen2ForCausalLM"),
    "LlamaForCausalLM": ("nanovllm.models.llama", "LlamaForCausalLM"),
}


def architecture(hf_config) -> str:
    """The supported architecture ``hf_config`` names, else a ValueError that lists them."""
    names = getattr(hf_config, "architectures", None) or []
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise ValueError(
        f"model architecture {', '.join(map(repr, names)) or '(none given in config.json)'} is not supported; "
        f"supported: {', '.join(ARCHITECTURES)}"
    )


def model_class(hf_config) -> type:
    module, name = ARCHITECTURES[architecture(hf_config)]
    return getattr(importlib.import_module(module), name)


def build_model(hf_config, quantization: str | None = None):
    """The model of ``hf_config``'s architecture, its linear layers in ``quantization`` (None or
    "fp8"), built on the current default device and dtype."""
    from nanovllm.quantization import building_quantized

    with building_quantized(quantization):
        return model_class(hf_config)(hf_config)
