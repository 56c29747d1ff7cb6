"""What the FP8 weight modules share: the block edge and quantized activation rows."""

from typing import NamedTuple

import torch

from nanovllm.utils.float8 import FP8_DTYPE, FP8_MAX

__all__ = ["BLOCK", "FP8_DTYPE", "FP8_MAX", "QuantizedRows"]

BLOCK = 128  # the block edge of weights, and the activation group size


class QuantizedRows(NamedTuple):
    """Activations already quantized by the op that produced them: ``q`` e4m3 [rows', k],
    ``scales`` float32 k-block-major [ceil(k/128), rows'], of which the first ``rows`` are real
    (GPU kernels pad to 16 rows with zeros of scale 1); ``dtype``: the activations' own."""

    q: torch.Tensor
    scales: torch.Tensor
    rows: int
    dtype: torch.dtype
