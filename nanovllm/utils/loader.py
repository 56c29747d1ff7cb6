"""Load a safetensors checkpoint: every tensor planned and checked before any is written."""

import os
from contextlib import contextmanager
from dataclasses import dataclass
from glob import glob

import torch
from safetensors import safe_open
from torch import nn


@dataclass(frozen=True)
class WeightEntry:
    """One checkpoint tensor's way in: ``params[target].weight_loader(param, tensor, *args)``."""

    index: int  # its position in the plan
    name: str  # the checkpoint (Hugging Face) name
    target: str  # the parameter it goes to (a fused one for q/k/v, gate/up and the experts)
    args: tuple  # the loader's arguments after the tensor: shard id, expert
    shape: tuple[int, ...]  # the full (unsharded) shape, as checked
    fp8: bool = False  # the tensor holds float8_e4m3fn values


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def packed_target(name: str, packed: dict) -> tuple[str, tuple]:
    for ckpt_key, (fused_key, shard_id) in packed.items():
        if f".{ckpt_key}." in name:
            return name.replace(ckpt_key, fused_key), (shard_id,)
    return name, ()


def checkpoint_shape(model: nn.Module, target: str, args: tuple) -> tuple[int, ...]:
    param = model.get_parameter(target)
    module = model.get_submodule(target.rpartition(".")[0])
    shape = getattr(param, "checkpoint_shape", None) or getattr(module, "checkpoint_shape", None)
    return tuple(shape(param, *args) if shape else param.shape)


def plan_weights(
    model: nn.Module, shapes: list[tuple[str, tuple[int, ...]]], where: str = ""
) -> list[WeightEntry]:
    """Where each ``(checkpoint name, shape)`` goes; an unknown name or a shape config.json
    does not imply is a ValueError."""
    packed = getattr(model, "packed_modules_mapping", {})
    map_name = getattr(model, "map_checkpoint_name", lambda name: None)
    params = dict(model.named_parameters(remove_duplicate=False))
    entries = []
    for index, (name, shape) in enumerate(shapes):
        mapped = map_name(name)
        target, args = mapped if mapped is not None else packed_target(name, packed)
        if target is None or name.endswith("rotary_emb.inv_freq"):  # None: the model skips it
            continue
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r}{where} has no matching model parameter")
        shape, expected = tuple(shape), checkpoint_shape(model, target, args)
        if shape != expected:
            msg = f"config.json implies {expected}: the tensor and the model's config.json disagree"
            raise ValueError(f"checkpoint tensor {name!r}{where} has shape {shape}, but {msg}")
        entries.append(WeightEntry(index, name, target, args, shape))
    return entries


def copy_weight(param: nn.Parameter, entry: WeightEntry, tensor: torch.Tensor, where="") -> None:
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        loader(param, tensor, *entry.args)
    except RuntimeError as e:  # a shape the check could not know
        raise ValueError(
            f"checkpoint tensor {entry.name!r}{where} with shape {tuple(tensor.shape)} does not "
            f"fit parameter {entry.target!r} with shape {tuple(param.shape)}: {e}"
        ) from e


def _missing(path: str, names: list[str]) -> None:
    if names:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(sorted(names)[:8])}")


def load_model(model: nn.Module, path: str, hf_config=None) -> None:
    """Copy ``path/*.safetensors`` into ``model``; a bad file, tensor or shape, or a parameter
    no tensor fills, is a ValueError before any weight loads."""
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in model folder {path!r}")
    params = dict(model.named_parameters(remove_duplicate=False))
    plan: list[tuple[str, list[WeightEntry]]] = []
    fp8: set[str] = set()  # the float8_e4m3fn tensors, by name
    for file in files:
        with _open(file) as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            shapes = [(name, tuple(s.get_shape())) for name, s in slices.items()]
            fp8 |= {name for name, s in slices.items() if s.get_dtype() == "F8_E4M3"}
        plan.append((file, plan_weights(model, shapes, f" in {file}")))
    if fp8 or any(p.dtype == torch.float8_e4m3fn for p in params.values()):
        from nanovllm.quantization.checks import check_fp8_tensors

        # a weight and its scales may lie in different files
        entries = [entry for _, entries in plan for entry in entries]
        check_fp8_tensors(model, entries, fp8, f" in {path}")
    loaded = {id(params[e.target]) for _, entries in plan for e in entries}  # tied: either name
    # a ``derived`` parameter (FP8 scales) may be filled by its weight's loader instead
    unfilled = [n for n, p in params.items() if id(p) not in loaded]
    _missing(path, [n for n in unfilled if not getattr(params[n], "derived", False)])
    for file, entries in plan:
        with _open(file) as f:
            for entry in entries:
                try:
                    tensor = f.get_tensor(entry.name)
                except Exception as e:
                    raise ValueError(f"cannot read tensor {entry.name!r} from {file}: {e}") from e
                copy_weight(params[entry.target], entry, tensor, f" in {file}")
    modules = model.named_modules()
    _missing(path, [f"{n}.{m}" for n, mod in modules for m in getattr(mod, "missing", list)()])


@contextmanager
def _open(file: str):  # safe_open, its errors naming the file
    try:
        handle = safe_open(file, "pt", "cpu")
    except OSError:
        raise
    except Exception as e:  # SafetensorError: a truncated file, or not a safetensors file
        raise ValueError(f"{file} is truncated or not a safetensors file: {e}") from e
    with handle as f:
        yield f
