"""``LoRARequest``: which adapter a request runs with (``vllm.lora.request``'s name)."""

from dataclasses import dataclass


@dataclass
class LoRARequest:
    """An adapter named ``lora_name`` under the id ``lora_int_id`` (>= 1), read from a PEFT folder
    (``lora_path``) or given in memory: ``lora_tensors`` (PEFT's tensor names) with
    ``peft_config`` (``adapter_config.json``'s keys). ``load_inplace=True`` replaces an adapter
    already loaded under this id."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False
    lora_tensors: dict | None = None
    peft_config: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest.lora_name must be a non-empty str, got {self.lora_name!r}"
            )
        i = self.lora_int_id
        if isinstance(i, bool) or not isinstance(i, int) or i < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {i!r}")
        if self.tensorizer_config_dict is not None:
            raise ValueError("LoRARequest.tensorizer_config_dict is not supported (only None)")
        if (self.lora_tensors is None) != (self.peft_config is None):
            raise ValueError("LoRARequest: give lora_tensors and peft_config together, or neither")
        if self.lora_tensors is None and not self.lora_path:
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_path (a PEFT adapter folder) or "
                "lora_tensors with peft_config is needed"
            )

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __hash__(self) -> int:
        return hash(self.lora_int_id)

    def __eq__(self, other) -> bool:
        return isinstance(other, LoRARequest) and self.lora_int_id == other.lora_int_id
