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
    shard id. A missing file, an unknown tensor or a parameter left unloaded is an error."""
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in model folder {path!r}")
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_names = set()
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                for ckpt_key, (fused_key, shard_id) in packed.items():
                    if f".{ckpt_key}." in name:
                        target = name.replace(ckpt_key, fused_key)
                        args = (shard_id,)
                        break
                else:
                    target, args = name, ()
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} in {file} has no matching model parameter")
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, f.get_tensor(name), *args)
                loaded_names.add(target)
    loaded_ids = {id(params[name]) for name in loaded_names}  # a tied weight loads under either name
    missing = [name for name, param in params.items() if id(param) not in loaded_ids]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(sorted(missing)[:8])}")
