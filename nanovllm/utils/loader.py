"""Load a Hugging Face safetensors checkpoint into a model built from the parallel layers."""
import os
from contextlib import contextmanager
from glob import glob

import torch
from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def load_model(model: nn.Module, path: str, hf_config=None) -> None:
    """Copy every tensor of ``path/*.safetensors`` into ``model``, each parameter taking its own
    shard through its ``weight_loader``. Checkpoint names that the model fuses
    (``model.packed_modules_mapping``, e.g. q/k/v -> qkv_proj) go to the fused parameter with their
    shard id; a model may map other names first (``model.map_checkpoint_name(name)`` -> (parameter
    name, loader arguments) or None), as Qwen3-MoE does for its per-expert tensors.

    Every file's header is read first, and before any weight loads, an unreadable or truncated
    file, an unknown tensor, a tensor whose shape is not the one ``config.json`` implies
    (``hf_config``, read from ``path`` when not given) or a parameter no tensor fills is a
    ValueError naming the file, the tensor and both shapes. An expert left unloaded is an error
    after loading."""
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in model folder {path!r}")
    expected = expected_shapes(path, hf_config)
    packed = getattr(model, "packed_modules_mapping", {})
    map_name = getattr(model, "map_checkpoint_name", lambda name: None)
    params = dict(model.named_parameters(remove_duplicate=False))
    plan: list[tuple[str, list[tuple[str, str, tuple]]]] = []  # file -> (tensor, parameter, loader arguments)
    for file in files:
        with _open(file) as f:
            entries = []
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                mapped = map_name(name)
                target, args = mapped if mapped is not None else packed_target(name, packed)
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} in {file} has no matching model parameter")
                shape = tuple(f.get_slice(name).get_shape())
                if name in expected and shape != expected[name]:
                    raise ValueError(
                        f"checkpoint tensor {name!r} in {file} has shape {shape}, but config.json implies "
                        f"{expected[name]}: the folder's config.json and weights disagree"
                    )
                entries.append((name, target, args))
            plan.append((file, entries))
    loaded_ids = {id(params[target]) for _, entries in plan for _, target, _ in entries}  # a tied weight loads under either name
    missing = [name for name, param in params.items() if id(param) not in loaded_ids]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(sorted(missing)[:8])}")
    for file, entries in plan:
        with _open(file) as f:
            for name, target, args in entries:
                param = params[target]
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"cannot read tensor {name!r} from {file}: {e}") from e
                try:
                    loader(param, tensor, *args)
                except RuntimeError as e:  # a shape the config check could not know
                    raise ValueError(
                        f"checkpoint tensor {name!r} in {file} with shape {tuple(tensor.shape)} does not fit "
                        f"parameter {target!r} with shape {tuple(param.shape)}: {e}"
                    ) from e
    missing = [f"{name}.{m}" for name, module in model.named_modules() for m in getattr(module, "missing", lambda: [])()]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(sorted(missing)[:8])}")


def expected_shapes(path: str, hf_config=None) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> the full (unsharded) shape the folder's config.json implies."""
    from nanovllm.utils.checkpoint import weight_shapes

    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path)
    values = hf_config.to_dict()  # under transformers' names, and under the aliases models read
    values.update({alias: getattr(hf_config, alias) for alias in getattr(hf_config, "attribute_map", {})})
    return {name: tuple(shape) for name, shape in weight_shapes(values).items()}


@contextmanager
def _open(file: str):
    """``safe_open`` whose errors name the file (safetensors' own do not)."""
    try:
        handle = safe_open(file, "pt", "cpu")
    except OSError:
        raise
    except Exception as e:  # SafetensorError: a truncated file, or not a safetensors file
        raise ValueError(f"{file} is truncated or not a safetensors file: {e}") from e
    with handle as f:
        yield f


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
