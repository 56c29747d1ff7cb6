"""cuBLAS's block-scaled FP8 GEMM (``F.scaled_mm``); docs/quantization.md."""

import torch
import torch.nn.functional as F

from nanovllm.quantization.fp8_types import BLOCK, FP8_DTYPE

MIN_ROWS = 128  # below, the Triton kernel (split-K, small tiles) is faster
ROW_MULTIPLE = 16
K_MULTIPLE = 4 * BLOCK  # the weight scales' k-blocks must come in fours


_available: dict[torch.device, bool] = {}


def available(device: torch.device) -> bool:
    # tried once per device outside a CUDA graph capture (the warm-up); False during one before
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
    """bf16 [rows, out] from e4m3 ``q`` [rows, in] and ``weight`` [out, in] with their scales."""
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
