"""Load a Hugging Face safetensors checkpoint into a model built from the parallel layers."""
import os
from glob import glob

import torch
from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of ``path/*.safetensors`` into ``model``, each parameter taking its own
    shard through its ``weight_loader``. Checkpoint names that the model fuses
    (``model.packed_modules_mapping``, e.g. q/k/v -> qkv_proj) go to the fused parameter with their
    shard id; a model may map other names first (``model.map_checkpoint_name(name)`` -> (parameter
    name, loader arguments) or None), as Qwen3-MoE does for its per-expert tensors. A missing file,
    an unknown tensor, a parameter left unloaded or an expert left unloaded is an error."""
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in model folder {path!r}")
    packed = getattr(model, "packed_modules_mapping", {})
    map_name = getattr(model, "map_checkpoint_name", lambda name: None)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_names = set()
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                mapped = map_name(name)
                if mapped is not None:
                    target, args = mapped
                else:
                    target, args = packed_target(name, packed)
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} in {file} has no matching model parameter")
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, f.get_tensor(name), *args)
                loaded_names.add(target)
    loaded_ids = {id(params[name]) for name in loaded_names}  # a tied weight loads under either name
    missing = [name for name, param in params.items() if id(param) not in loaded_ids]
    for name, module in model.named_modules():
        missing += [f"{name}.{m}" for m in getattr(module, "missing", lambda: [])()]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(sorted(missing)[:8])}")


def packed_target(name: str, packed: dict) -> tuple[str, tuple]:
    """(parameter name, loader arguments) of a checkpoint tensor under ``packed_modules_mapping``."""
    for ckpt_key, (fused_key, shard_id) in packed.items():
        if f".{ckpt_key}." in name:
            return name.replace(ckpt_key, fused_key), (shard_id,)
    return name, ()


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """``load_format="dummy"``: no files; norm weights 1, biases 0, everything else N(0, std), drawn
    on the parameters' device from one seed, so every rank draws the same (a replicated router
    agrees across ranks). For benchmarks of shapes too large to write to disk."""
    generators = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            device = param.device
            if device not in generators:
                generators[device] = torch.Generator(device=device).manual_seed(seed)
            param.data.normal_(0.0, std, generator=generators[device])
