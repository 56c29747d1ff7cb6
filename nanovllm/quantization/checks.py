"""Checks of float8 tensors loaded into an FP8 model."""

from dataclasses import replace

from torch import nn

from nanovllm.utils.float8 import FP8_DTYPE


def is_fp8_model(model: nn.Module) -> bool:
    return any(param.dtype == FP8_DTYPE for param in model.parameters())


def check_fp8_tensors(model: nn.Module, entries: list, fp8: set[str], where: str = "") -> list:
    """``entries`` with ``fp8`` set; raises on unpaired e4m3 weights and scales."""
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
