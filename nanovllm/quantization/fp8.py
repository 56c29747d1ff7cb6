"""Block-wise FP8 (e4m3) arithmetic: the torch reference of W8A8 as Qwen's FP8 checkpoints intend
it, and the CPU path. A GPU kernel must compute exactly this.

Weights are float8_e4m3fn in 128x128 blocks, each block with one float32 scale (Qwen's
``weight_scale_inv``: the real weight is ``weight * weight_scale_inv``). Activations are quantized
when they arrive, per token and per group of 128 input channels. A quantized block's scale is its
absolute maximum / 448 (e4m3's largest finite value), 1 for an all-zero block; its values are
x / scale, clamped to [-448, 448] and rounded to the nearest e4m3 value (ties to even).

``fp8_linear``: for each 128-wide k-block, the product of the e4m3 values accumulated in float32,
times (the token's activation scale for that group) x (the weight scale of that output block and
k-block); the k-blocks' results summed in float32, in order, then cast to the activation dtype.
"""

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
BLOCK = 128  # the block edge of weights, and the activation group size


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, or 1 where amax is 0. Divided by a tensor: CUDA turns a division by a Python
    number into a multiplication by its reciprocal, one ulp away from the CPU's quotient."""
    scale = amax / torch.full_like(amax, FP8_MAX)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_weight_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [..., out, in] (any float dtype) -> (float8_e4m3fn [..., out, in], float32 scales
    [..., ceil(out/128), ceil(in/128)]). Edge blocks may be smaller than 128x128."""
    *lead, rows, cols = weight.shape
    pad_rows, pad_cols = _blocks(rows) * BLOCK - rows, _blocks(cols) * BLOCK - cols
    w = torch.nn.functional.pad(
        weight.float(), (0, pad_cols, 0, pad_rows)
    )  # zeros do not change a max
    blocks = w.reshape(*lead, _blocks(rows), BLOCK, _blocks(cols), BLOCK)  # [..., rb, 128, cb, 128]
    scale = _scale(blocks.abs().amax(dim=(-3, -1)))  # [..., rb, cb]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, _blocks(rows) * BLOCK, _blocks(cols) * BLOCK)[..., :rows, :cols]
    return q.contiguous(), scale


def dequantize_weight_blocks(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The real weight in float32: ``weight`` [..., out, in] e4m3 times its block's scale."""
    rows, cols = weight.shape[-2:]
    full = scale.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[
        ..., :rows, :cols
    ]
    return weight.float() * full


def quantize_activation_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [tokens, k] -> (float8_e4m3fn [tokens, k], float32 scales [tokens, ceil(k/128)]): one
    scale per token and group of 128 channels (the last group may be narrower)."""
    tokens, k = x.shape
    pad = _blocks(k) * BLOCK - k
    groups = torch.nn.functional.pad(x.float(), (0, pad)).view(tokens, _blocks(k), BLOCK)
    scale = _scale(groups.abs().amax(dim=-1))  # [tokens, groups]
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(tokens, _blocks(k) * BLOCK)[:, :k], scale


class QuantizedRows(NamedTuple):
    """Activations already quantized (by the op that produced them, ``fp8_fused``): ``q`` e4m3
    [rows', k] and ``scales`` float32 k-block-major [ceil(k/128), rows'], of which the first
    ``rows`` are real (the GPU's kernels pad to 16 rows for cuBLAS, with zeros of scale 1);
    ``dtype``: the activations' own (a linear's default output dtype)."""

    q: torch.Tensor
    scales: torch.Tensor
    rows: int
    dtype: torch.dtype


def quantize_to_rows(x: torch.Tensor) -> QuantizedRows:
    """``quantize_activation_groups`` of ``x`` [tokens, k], as ``QuantizedRows``."""
    q, scale = quantize_activation_groups(x)
    return QuantizedRows(q, scale.T, x.shape[0], x.dtype)


def fp8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x`` [..., in] (or its ``QuantizedRows``) @ the block-quantized ``weight`` [out, in].T (+
    ``bias``), W8A8 as the module docstring says; the result in ``out_dtype`` (default: x's dtype;
    the bias added after the cast)."""
    if (
        x.q if isinstance(x, QuantizedRows) else x
    ).is_cuda:  # Triton/cuBLAS kernels, the same arithmetic
        from nanovllm.quantization.fp8_triton import fp8_linear_triton

        return fp8_linear_triton(x, weight, weight_scale, bias, out_dtype)
    if isinstance(x, QuantizedRows):
        lead, k = (x.rows,), x.q.shape[1]
        xq, x_scale = x.q[: x.rows], x.scales[:, : x.rows].T
    else:
        lead, k = x.shape[:-1], x.shape[-1]
        xq, x_scale = quantize_activation_groups(x.reshape(-1, k))
    out_features = weight.shape[0]
    xf, wf = xq.float(), weight.float()
    w_scale = weight_scale.repeat_interleave(BLOCK, dim=0)[:out_features]  # [out, k-blocks]
    acc = torch.zeros(xf.shape[0], out_features, dtype=torch.float32, device=xf.device)
    for kb in range(_blocks(k)):
        cols = slice(kb * BLOCK, min(k, (kb + 1) * BLOCK))
        partial = xf[:, cols] @ wf[:, cols].T  # [tokens, out], exact products, float32 sums
        acc += partial * (x_scale[:, kb, None] * w_scale[None, :, kb])
    y = acc.to(out_dtype or x.dtype).view(*lead, out_features)
    return y if bias is None else y + bias
