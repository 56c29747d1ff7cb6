"""FP8 types."""

from typing import NamedTuple

import torch

from nanovllm.utils.float8 import FP8_DTYPE, FP8_MAX

__all__ = ["BLOCK", "FP8_DTYPE", "FP8_MAX", "QuantizedRows"]

BLOCK = 128  # the block edge of weights, and the activation group size


class QuantizedRows(NamedTuple):
    """Activations already quantized."""

    q: torch.Tensor  # e4m3 [rows', k]
    scales: torch.Tensor  # float32 [ceil(k/128), rows'], k-block-major
    rows: int  # the real rows; GPU kernels pad to 16 with zeros of scale 1
    dtype: torch.dtype  # the activations' own
