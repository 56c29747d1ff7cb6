import torch
from torch import nn

from nanovllm.layers import small_batch
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
    """RMSNorm in float32; with ``residual``, ``(norm(x + residual), x + residual)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x not a tensor: a split few-rows GEMM's K ranges to add up (rows_gemm.RangeSums)
        if not isinstance(x, torch.Tensor) or small_batch.takes(x):
            from nanovllm.layers import few_rows

            return few_rows.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
