"""Load a Hugging Face safetensors checkpoint into a model built from the parallel layers, from its
files or from tensors in memory (``update_weights``): both go through ``plan_weights``, which
checks every tensor before any is written, and ``copy_weight``, which writes one in place."""

import os
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from glob import glob

import torch
from safetensors import safe_open
from torch import nn


@dataclass(frozen=True)
class WeightEntry:
    """One checkpoint tensor's way into the model: ``params[target].weight_loader(param, tensor,
    *args)``. ``index``: its position in what was planned. Plain data: it travels to the
    tensor-parallel workers through the control channel, the tensor itself by a broadcast."""

    index: int
    name: str  # the checkpoint (Hugging Face) name
    target: str  # the parameter it goes to (a fused one for q/k/v, gate/up and the experts)
    args: tuple  # the loader's arguments after the tensor: shard id, expert
    shape: tuple[int, ...]  # the full (unsharded) shape, as checked
    fp8: bool = False  # the tensor holds float8_e4m3fn values (update_weights: they travel as such)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def plan_weights(
    model: nn.Module,
    shapes: Iterable[tuple[str, tuple[int, ...]]],
    expected: dict[str, tuple[int, ...]],
    where: str = "",
) -> list[WeightEntry]:
    """Where each ``(checkpoint name, shape)`` goes, every one checked before anything is written:
    a name the model does not have, or a shape that is not the one ``config.json`` implies
    (``expected``, from ``expected_shapes``), is a ValueError naming the tensor, ``where`` it
    comes from and both shapes. Names the model fuses (``model.packed_modules_mapping``, e.g.
    q/k/v -> qkv_proj) go to the fused parameter with their shard id; a model may map other names
    first (``model.map_checkpoint_name(name)`` -> (parameter name, loader arguments) or None), as
    Qwen3-MoE does for its per-expert tensors. RoPE's ``inv_freq`` buffers are skipped."""
    packed = getattr(model, "packed_modules_mapping", {})
    map_name = getattr(model, "map_checkpoint_name", lambda name: None)
    params = dict(model.named_parameters(remove_duplicate=False))
    entries = []
    for index, (name, shape) in enumerate(shapes):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        mapped = map_name(name)
        target, args = mapped if mapped is not None else packed_target(name, packed)
        if target not in params or name not in expected:
            raise ValueError(f"checkpoint tensor {name!r}{where} has no matching model parameter")
        shape = tuple(shape)
        if shape != expected[name]:
            raise ValueError(
                f"checkpoint tensor {name!r}{where} has shape {shape}, but config.json implies "
                f"{expected[name]}: the tensor and the model's config.json disagree"
            )
        entries.append(WeightEntry(index, name, target, args, shape))
    return entries


def copy_weight(
    param: nn.Parameter, entry: WeightEntry, tensor: torch.Tensor, where: str = ""
) -> None:
    """Copy this rank's shard of ``tensor`` into ``param`` in place (its storage is kept, so CUDA
    graphs stay valid), through the parameter's ``weight_loader``; the copy converts the dtype
    and the device."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        loader(param, tensor, *entry.args)
    except RuntimeError as e:  # a shape the config check could not know
        raise ValueError(
            f"checkpoint tensor {entry.name!r}{where} with shape {tuple(tensor.shape)} does not fit "
            f"parameter {entry.target!r} with shape {tuple(param.shape)}: {e}"
        ) from e


def load_model(model: nn.Module, path: str, hf_config=None) -> None:
    """Copy every tensor of ``path/*.safetensors`` into ``model``, each parameter taking its own
    shard through its ``weight_loader`` (``plan_weights``, ``copy_weight``).

    Every file's header is read first, and before any weight loads, an unreadable or truncated
    file, an unknown tensor, a tensor whose shape is not the one ``config.json`` implies
    (``hf_config``, read from ``path`` when not given) or a parameter no tensor fills is a
    ValueError naming the file, the tensor and both shapes, and so is an FP8 weight that does not
    come with its scales as a pair (``check_fp8_tensors``). An expert left unloaded is an error
    after loading."""
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in model folder {path!r}")
    expected = expected_shapes(path, hf_config, fp8=is_fp8_model(model))
    params = dict(model.named_parameters(remove_duplicate=False))
    plan: list[tuple[str, list[WeightEntry]]] = []
    fp8: set[str] = set()  # the float8_e4m3fn tensors, by name
    for file in files:
        with _open(file) as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            shapes = [(name, tuple(s.get_shape())) for name, s in slices.items()]
            fp8 |= {name for name, s in slices.items() if s.get_dtype() == "F8_E4M3"}
        plan.append((file, plan_weights(model, shapes, expected, f" in {file}")))
    # a weight and its scales may lie in different files
    check_fp8_tensors(
        model, [entry for _, entries in plan for entry in entries], fp8, f" in {path}"
    )
    # a tied weight loads under either name
    loaded_ids = {id(params[e.target]) for _, entries in plan for e in entries}
    # an FP8 layer's scales may come from the file or from quantizing a float weight: its ``missing()`` says
    missing = [
        name
        for name, param in params.items()
        if id(param) not in loaded_ids and not name.endswith("scale_inv")
    ]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(sorted(missing)[:8])}")
    for file, entries in plan:
        with _open(file) as f:
            for entry in entries:
                try:
                    tensor = f.get_tensor(entry.name)
                except Exception as e:
                    raise ValueError(f"cannot read tensor {entry.name!r} from {file}: {e}") from e
                copy_weight(params[entry.target], entry, tensor, f" in {file}")
    missing = [
        f"{name}.{m}"
        for name, module in model.named_modules()
        for m in getattr(module, "missing", lambda: [])()
    ]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(sorted(missing)[:8])}")


def named_tensors(weights) -> list[tuple[str, torch.Tensor]]:
    """``update_weights``' argument as a list, read once (it may be a generator): ``(name,
    tensor)`` pairs, or a mapping of them. A pair that is not a name and a floating-point tensor
    is a TypeError naming it. The tensors are detached (a trainer's may require grad)."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    try:
        items = list(items)
    except TypeError:
        raise TypeError(
            f"weights must be an iterable of (name, tensor) pairs, got {type(weights).__name__}"
        ) from None
    named = []
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(
                f"weights[{i}] must be a (name, tensor) pair, got {type(item).__name__}"
            )
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"weight {name!r} must be a floating-point tensor, got {tensor.dtype}")
        named.append((name, tensor.detach()))
    return named


def expected_shapes(path: str, hf_config=None, fp8: bool = False) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> the full (unsharded) shape the folder's config.json implies, under
    every name a checkpoint or a transformers ``state_dict()`` may use (``accepted_shapes``); with
    ``fp8``, the block scales of the quantized layers' weights too (``weight_scale_inv``)."""
    from nanovllm.utils.checkpoint import accepted_shapes

    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path)
    values = hf_config.to_dict()  # under transformers' names, and under the aliases models read
    values.update(
        {alias: getattr(hf_config, alias) for alias in getattr(hf_config, "attribute_map", {})}
    )
    return {name: tuple(shape) for name, shape in accepted_shapes(values, fp8).items()}


def is_fp8_model(model: nn.Module) -> bool:
    return any(param.dtype == torch.float8_e4m3fn for param in model.parameters())


def check_fp8_tensors(
    model: nn.Module, entries: list[WeightEntry], fp8: set[str], where: str = ""
) -> list[WeightEntry]:
    """``entries`` with their ``fp8`` flag set (``fp8``: the names of those whose tensors are
    float8_e4m3fn), checked: in an FP8 model a float weight is quantized on load, a float8_e4m3fn
    one needs its ``weight_scale_inv`` among the entries and a scale needs its float8 weight (the
    two belong together). A float8 tensor for a parameter that is not FP8 is a TypeError; a broken
    pair a ValueError."""
    params = dict(model.named_parameters(remove_duplicate=False))
    names = {entry.name for entry in entries}
    for entry in entries:
        is_scale = entry.name.endswith("_scale_inv")
        if entry.name in fp8 and params[entry.target].dtype != torch.float8_e4m3fn:
            raise TypeError(
                f"weight {entry.name!r}{where} is float8_e4m3fn, but its parameter {entry.target!r} is "
                f"{params[entry.target].dtype}; give it in a float dtype"
            )
        if is_scale and entry.name.removesuffix("_scale_inv") not in fp8:
            raise ValueError(
                f"scale {entry.name!r}{where} comes without its float8_e4m3fn weight "
                f"{entry.name.removesuffix('_scale_inv')!r}; give both, or the weight alone in a float dtype"
            )
        if entry.name in fp8 and entry.name + "_scale_inv" not in names:
            raise ValueError(
                f"weight {entry.name!r}{where} is float8_e4m3fn without its scales "
                f"{entry.name + '_scale_inv'!r}; give both, or the weight alone in a float dtype"
            )
    return [replace(entry, fp8=entry.name in fp8) for entry in entries]


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
    agrees across ranks). An FP8 weight is drawn in float32 and quantized, its scales with it.
    For benchmarks of shapes too large to write to disk."""
    from nanovllm.quantization.fp8 import FP8_DTYPE, quantize_weight_blocks

    generators = {}
    params = dict(model.named_parameters())
    for name, param in params.items():
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        if name.endswith("scale_inv"):
            continue  # set with its weight
        if param.dtype == FP8_DTYPE:
            drawn = torch.empty(param.shape, dtype=torch.float32, device=device)
            q, scale = quantize_weight_blocks(drawn.normal_(0.0, std, generator=generators[device]))
            param.data.copy_(q)
            params[name + "_scale_inv"].data.copy_(scale)
        elif name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, std, generator=generators[device])
