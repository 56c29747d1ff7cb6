"""``LoRAConfig``: the engine's adapter limits, from vLLM's ``enable_lora`` options."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """``max_loras`` adapters on the device at once, ranks up to ``max_lora_rank``, up to
    ``max_cpu_loras`` (>= max_loras) kept on the host."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is None and name == "max_cpu_loras":
                object.__setattr__(self, name, self.max_loras)
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LLM() option {name} must be an int >= 1, got {value!r}")
        if self.max_lora_rank > 256:
            raise ValueError(f"LLM() option max_lora_rank must be <= 256, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            msg = f"must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}"
            raise ValueError(f"LLM() option max_cpu_loras {msg}")


def lora_config(enable_lora=False, max_loras=None, max_lora_rank=None, max_cpu_loras=None):
    """vLLM's four options as one ``LoRAConfig`` (None: LoRA off)."""
    if not isinstance(enable_lora, bool):
        raise ValueError(f"LLM() option enable_lora must be a bool, got {enable_lora!r}")
    if not enable_lora:
        return None
    given = {"max_loras": max_loras, "max_lora_rank": max_lora_rank}
    given["max_cpu_loras"] = max_cpu_loras
    return LoRAConfig(**{k: v for k, v in given.items() if v is not None})
