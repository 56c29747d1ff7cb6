import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers import small_batch
from nanovllm.utils.compile import compile_on_gpu


@compile_on_gpu
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """[gate | up] on the last dim -> SiLU(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if small_batch.takes(x):
            from nanovllm.layers import few_rows

            return few_rows.silu_and_mul(x)
        return silu_and_mul(x)
