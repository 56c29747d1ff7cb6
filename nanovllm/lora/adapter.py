"""A LoRA adapter read from a PEFT folder or from tensors, checked against the base model."""

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from nanovllm.lora.request import LoRARequest

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# a PEFT tensor name: ...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>[.<adapter name>].weight
TENSOR_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass
class Adapter:
    """``weights[(layer, module)] = (A [r, in], B [out, r] times the scaling)``, float32 on the
    host; ``serial`` is unique to this load (it keys the adapter's prefix-cache blocks)."""

    request: LoRARequest
    weights: dict
    serial: int

    @property
    def name(self) -> str:
        return self.request.lora_name


GATED_QUERY = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")  # q_proj: [query | gate]


def module_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """Each target module's (input, output) features."""
    from nanovllm.models.config import head_dim

    hd, hidden = head_dim(hf_config), hf_config.hidden_size
    q, kv = hf_config.num_attention_heads * hd, hf_config.num_key_value_heads * hd
    inter = getattr(hf_config, "intermediate_size", None)
    q_out = 2 * q if hf_config.model_type in GATED_QUERY else q
    shapes = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv), "v_proj": (hidden, kv)}
    shapes.update(o_proj=(q, hidden), gate_proj=(hidden, inter), up_proj=(hidden, inter))
    return shapes | {"down_proj": (inter, hidden)}


def load_adapter(request: LoRARequest, hf_config, max_rank: int, serial: int) -> Adapter:
    """ValueError naming the adapter, the tensor or key and the value for what cannot run."""
    where = f"LoRA adapter {request.lora_name!r}"
    if request.lora_tensors is not None:
        config, tensors = request.peft_config, dict(request.lora_tensors)
    else:
        config, tensors = _read_folder(request.lora_path, where)
    rank, scaling = _check_config(config, where, max_rank)
    shapes = module_shapes(hf_config)
    parts: dict = {}
    for name, tensor in tensors.items():
        match = TENSOR_NAME.search(name)
        if match is None:
            msg = "is not a LoRA A/B weight of an attention or MLP projection of a decoder layer"
            raise ValueError(f"{where}: tensor {name!r} {msg}")
        layer, module, kind = int(match[1]), match[2], match[3]
        _check_module(hf_config, layer, module, where, name)
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            raise ValueError(f"{where}: tensor {name!r} must be a 2-D torch.Tensor")
        n_in, n_out = shapes[module]
        expected = (rank, n_in) if kind == "A" else (n_out, rank)
        if tuple(tensor.shape) != expected:
            got = tuple(tensor.shape)
            msg = f"has shape {got}, the base model's {module} needs {expected} (r={rank})"
            raise ValueError(f"{where}: tensor {name!r} {msg}")
        parts.setdefault((layer, module), {})[kind] = tensor
    weights = {}
    for key, pair in sorted(parts.items()):
        if len(pair) != 2:
            lacking = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"{where}: layer {key[0]} {key[1]} has no {lacking} weight")
        a, b = (pair[k].detach().to("cpu", torch.float32) for k in "AB")  # kept on the host
        weights[key] = (a.contiguous(), (b * scaling).contiguous())
    if not weights:
        raise ValueError(f"{where}: no LoRA weights found")
    return Adapter(request, weights, serial)


def _read_folder(path: str, where: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    config_file, weights_file = (os.path.join(path, f) for f in (CONFIG_FILE, WEIGHTS_FILE))
    for file in (config_file, weights_file):
        if not os.path.isfile(file):
            raise ValueError(f"{where}: {file} does not exist (a PEFT adapter folder is needed)")
    try:
        with open(config_file) as f:
            config = json.load(f)
        tensors = load_file(weights_file)
    except Exception as e:  # unreadable JSON or safetensors
        raise ValueError(f"{where}: cannot read {path}: {e}") from e
    return config, tensors


def _check_config(config, where: str, max_rank: int) -> tuple[int, float]:
    """The rank and the scaling (lora_alpha / r, or / sqrt(r) with rsLoRA)."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: the PEFT config must be a dict, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config['peft_type']!r} is not supported (only LORA)")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r must be an int >= 1, got {r!r}")
    if r > max_rank:
        raise ValueError(f"{where}: r={r} is above max_lora_rank={max_rank}; raise max_lora_rank")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    unsupported = {"bias": "none", "use_dora": False, "modules_to_save": None}
    unsupported |= {"rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None}
    for key, neutral in unsupported.items():
        value = config.get(key, neutral)
        if value != neutral and value not in (None, [], {}, False):
            raise ValueError(f"{where}: {key}={value!r} is not supported (only {neutral!r})")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        for module in targets:
            if module not in ATTENTION + MLP:
                supported = ", ".join(ATTENTION + MLP)
                msg = f"is not supported; supported: {supported}"
                raise ValueError(f"{where}: target module {module!r} {msg}")
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def _check_module(hf_config, layer: int, module: str, where: str, name: str) -> None:
    if module not in ATTENTION + MLP:
        supported = ", ".join(ATTENTION + MLP)
        raise ValueError(
            f"{where}: tensor {name!r}: module {module!r} is not supported ({supported})"
        )
    if layer >= hf_config.num_hidden_layers:
        layers = hf_config.num_hidden_layers
        raise ValueError(f"{where}: tensor {name!r}: layer {layer}, the model has {layers}")
    if module in MLP and getattr(hf_config, "num_experts", 0):
        from nanovllm.models.qwen3_moe import is_sparse_layer

        if is_sparse_layer(hf_config, layer):
            msg = "is a mixture-of-experts block: LoRA on experts is not supported"
            raise ValueError(f"{where}: tensor {name!r}: layer {layer}'s MLP {msg}")
