"""Block FP8 W8A8 arithmetic in torch: the GPU kernels' reference and the CPU path."""

import torch

from nanovllm.quantization.fp8_types import BLOCK, FP8_DTYPE, FP8_MAX, QuantizedRows

__all__ = ["BLOCK", "FP8_DTYPE", "FP8_MAX", "QuantizedRows", "fp8_linear"]


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    # divided by a tensor: CUDA turns a division by a Python number into a multiply by its
    # reciprocal, one ulp away from the CPU's quotient
    scale = amax / torch.full_like(amax, FP8_MAX)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_weight_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scales [..., ceil(out/128), ceil(in/128)])."""
    *lead, rows, cols = weight.shape
    pad_rows, pad_cols = _blocks(rows) * BLOCK - rows, _blocks(cols) * BLOCK - cols
    w = torch.nn.functional.pad(weight.float(), (0, pad_cols, 0, pad_rows))  # zeros: same max
    blocks = w.reshape(*lead, _blocks(rows), BLOCK, _blocks(cols), BLOCK)  # [..., rb, 128, cb, 128]
    scale = _scale(blocks.abs().amax(dim=(-3, -1)))  # [..., rb, cb]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, _blocks(rows) * BLOCK, _blocks(cols) * BLOCK)[..., :rows, :cols]
    return q.contiguous(), scale


def dequantize_weight_blocks(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = weight.shape[-2:]
    full = scale.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    full = full[..., :rows, :cols]
    return weight.float() * full


def quantize_activation_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [tokens, k], float32 scales [tokens, ceil(k/128)])."""
    tokens, k = x.shape
    pad = _blocks(k) * BLOCK - k
    groups = torch.nn.functional.pad(x.float(), (0, pad)).view(tokens, _blocks(k), BLOCK)
    scale = _scale(groups.abs().amax(dim=-1))  # [tokens, groups]
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(tokens, _blocks(k) * BLOCK)[:, :k], scale


def quantize_to_rows(x: torch.Tensor) -> QuantizedRows:
    q, scale = quantize_activation_groups(x)
    return QuantizedRows(q, scale.T, x.shape[0], x.dtype)


def fp8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x`` [..., in] @ ``weight``.T in ``out_dtype`` (default x's), then ``bias``."""
    if (x.q if isinstance(x, QuantizedRows) else x).is_cuda:
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
