"""The loader's parts that ``update_weights`` uses."""

from collections.abc import Mapping

import torch

from nanovllm.quantization.checks import check_fp8_tensors, is_fp8_model
from nanovllm.utils.loader import WeightEntry, copy_weight, plan_weights

__all__ = [
    "WeightEntry",
    "check_fp8_tensors",
    "copy_weight",
    "is_fp8_model",
    "named_tensors",
    "plan_weights",
]


def named_tensors(weights) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs (or a mapping) as a list of detached tensors; anything that could
    not be copied is refused, naming it."""
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
        _check_copyable(name, tensor)
        named.append((name, tensor.detach()))
    return named


def _check_copyable(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_meta:
        raise ValueError(f"weight {name!r} is on the meta device: it holds no values to copy")
    if tensor.layout != torch.strided or tensor.is_nested or tensor.is_quantized:
        layout = "nested" if tensor.is_nested else tensor.layout
        raise TypeError(f"weight {name!r} must be a dense (strided) tensor, got {layout}")
    dispatch = getattr(type(tensor), "__torch_dispatch__", None)
    if dispatch is not None and dispatch is not torch.Tensor.__torch_dispatch__:
        raise TypeError(
            f"weight {name!r} must be a plain tensor, got a {type(tensor).__name__} (a tensor "
            "subclass with its own dispatch: pass its full local tensor)"
        )
