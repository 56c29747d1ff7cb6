"""Checks of float8 tensors on their way into an FP8 model (checkpoint files and
``update_weights``)."""

from dataclasses import replace

from torch import nn

from nanovllm.utils.float8 import FP8_DTYPE


def is_fp8_model(model: nn.Module) -> bool:
    return any(param.dtype == FP8_DTYPE for param in model.parameters())


def check_fp8_tensors(model: nn.Module, entries: list, fp8: set[str], where: str = "") -> list:
    """``entries`` (``WeightEntry``) with their ``fp8`` flag set (``fp8``: names of float8_e4m3fn
    tensors), checked: a float8 tensor for a parameter that is not FP8 is a TypeError; a float8
    weight without its ``weight_scale_inv`` among the entries, or a scale without its float8
    weight, a ValueError. A float weight alone is quantized on load."""
    params = dict(model.named_parameters(remove_duplicate=False))
    names = {entry.name for entry in entries}
    for entry in entries:
        weight = entry.name.removesuffix("_scale_inv")
        if entry.name in fp8 and params[entry.target].dtype != FP8_DTYPE:
            raise TypeError(
                f"weight {entry.name!r}{where} is float8_e4m3fn, but its parameter "
                f"{entry.target!r} is {params[entry.target].dtype}; give it in a float dtype"
            )
        if weight != entry.name and weight not in fp8:
            raise ValueError(
                f"scale {entry.name!r}{where} comes without its float8_e4m3fn weight {weight!r}; "
                "give both, or the weight alone in a float dtype"
            )
        if entry.name in fp8 and entry.name + "_scale_inv" not in names:
            raise ValueError(
                f"weight {entry.name!r}{where} is float8_e4m3fn without its scales "
                f"{entry.name + '_scale_inv'!r}; give both, or the weight alone in a float dtype"
            )
    return [replace(entry, fp8=entry.name in fp8) for entry in entries]
