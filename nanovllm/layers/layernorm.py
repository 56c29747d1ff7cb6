import torch
from torch import nn

from nanovllm.parallel.distributed import all_reduce
from nanovllm.utils.compile import compile_on_gpu


@compile_on_gpu
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # out of place throughout: x.float() is x itself when x is already float32
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@compile_on_gpu
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return rms_norm.__wrapped__(x, weight, eps), x


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. With ``residual`` it first adds it (fused residual add) and
    returns ``(normed, x + residual)``. Nothing is updated in place, so the caller's tensors stay
    intact in every dtype. ``quantize``: the normed rows come quantized for the FP8 linear that
    reads them (``QuantizedRows``, see ``quantization/fp8_fused.py``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, quantize: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.quantize = quantize
        self.reduces_input = (
            False  # True: with a residual, x is a row-parallel layer's unsummed output
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None and self.reduces_input:
            if not self.quantize:
                from nanovllm.parallel.reduce_norm import reduce_add_rms_norm

                return reduce_add_rms_norm(x, residual, self.weight, self.eps)
            all_reduce(x)
        if self.quantize:
            from nanovllm.quantization.fp8_fused import rms_norm_quantized

            return rms_norm_quantized(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
