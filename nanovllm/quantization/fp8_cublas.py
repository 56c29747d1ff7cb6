"""cuBLAS's block-scaled FP8 GEMM (``torch.nn.functional.scaled_mm`` with 1x128 activation scales and
128x128 weight scales, on Hopper): the arithmetic of ``fp8.py``'s torch path — e4m3 products summed
inside each 128-wide k-block, the block's sum promoted to float32 and scaled by (activation scale x
weight scale), the k-blocks added in float32. ``fp8_triton.fp8_linear_triton`` hands it the GEMM
from ``MIN_ROWS`` rows on, where it measures faster than the Triton kernel (BENCHMARKS.md); the
activations are quantized by the same Triton kernel either way.

cuBLAS wants the activation scales M-major ([k-blocks, rows] in memory, which is how
``quantize_rows`` writes them), the weight column-major (``weight.t()`` of the [out, in] tensor) and
rows in multiples of ``ROW_MULTIPLE`` (the quantized activations are padded with zero rows) and
input sizes in multiples of ``K_MULTIPLE``."""

import torch
import torch.nn.functional as F

from nanovllm.quantization.fp8_types import BLOCK, FP8_DTYPE

MIN_ROWS = 128  # below, the Triton kernel (split-K, small tiles) is faster
ROW_MULTIPLE = 16
K_MULTIPLE = 4 * BLOCK  # the weight scales' k-blocks must come in fours


_available: dict[torch.device, bool] = {}


def available(device: torch.device) -> bool:
    """Whether torch and the GPU run the block-scaled GEMM: one small call tried on a device's first
    use outside a CUDA graph capture (the engine's warm-up), remembered; during a capture before it,
    False."""
    if device not in _available:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        _available[device] = _try(device)
    return _available[device]


def _try(device: torch.device) -> bool:
    if (
        device.type != "cuda"
        or not hasattr(F, "scaled_mm")
        or torch.cuda.get_device_capability(device) != (9, 0)
    ):
        return False
    k = K_MULTIPLE
    q = torch.zeros(ROW_MULTIPLE, k, dtype=FP8_DTYPE, device=device)
    scales = torch.ones(k // BLOCK, ROW_MULTIPLE, device=device)
    w = torch.zeros(BLOCK, k, dtype=FP8_DTYPE, device=device)
    try:
        gemm(q, scales, w, torch.ones(1, k // BLOCK, device=device))
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


def usable(m: int, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """``m`` rows times ``weight`` [out, in] into ``out_dtype`` can take cuBLAS's GEMM."""
    n, k = weight.shape
    return (
        m >= MIN_ROWS
        and out_dtype == torch.bfloat16
        and n % BLOCK == 0
        and k % K_MULTIPLE == 0
        and weight.is_contiguous()
        and available(weight.device)
    )


def gemm(
    q: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """``q`` [rows, in] e4m3 (rows a multiple of ``ROW_MULTIPLE``) with ``scales`` [in / 128, rows],
    times ``weight`` [out, in] e4m3 with ``weight_scale`` [out / 128, in / 128] -> bf16 [rows, out]."""
    recipe = F.ScalingType
    return F.scaled_mm(
        q,
        weight.t(),
        scales.t(),
        recipe.BlockWise1x128,
        weight_scale.t(),
        recipe.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )
