"""Which model class runs a checkpoint, and which quantization builds its layers."""

import importlib

# architecture -> (module, class)
ARCHITECTURES = {
    "Qwen3ForCausalLM": ("nanovllm.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3_5ForCausalLM": ("nanovllm.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("nanovllm.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("nanovllm.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3MoeForCausalLM": ("nanovllm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2ForCausalLM": ("nanovllm.models.qwen2", "Qwen2ForCausalLM"),
    "LlamaForCausalLM": ("nanovllm.models.llama", "LlamaForCausalLM"),
}
# quantization -> (module, class) of its build-time configuration
QUANTIZATIONS = {"fp8": ("nanovllm.quantization.fp8_method", "Fp8Config")}


def _load(entry: tuple[str, str]):
    module, name = entry
    return getattr(importlib.import_module(module), name)


def architecture(hf_config) -> str:
    names = getattr(hf_config, "architectures", None) or []
    for name in names:
        if name in ARCHITECTURES:
            return name
    given = ", ".join(map(repr, names)) or "(none given in config.json)"
    msg = f"is not supported; supported: {', '.join(ARCHITECTURES)}"
    raise ValueError(f"model architecture {given} {msg}")


def model_class(hf_config) -> type:
    return _load(ARCHITECTURES[architecture(hf_config)])


def build_model(hf_config, quantization: str | None = None):
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    quant_config = _load(QUANTIZATIONS[quantization])() if quantization else None
    return model_class(hf_config)(hf_config, quant_config)
