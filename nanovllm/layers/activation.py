import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.compile import compile_on_gpu


@compile_on_gpu
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """SwiGLU: the input is [gate | up] on the last dim; returns SiLU(gate) * up. ``quantize``:
    quantized for the FP8 linear that reads it (``QuantizedRows``, ``quantization/fp8_fused.py``)."""

    def __init__(self, quantize: bool = False):
        super().__init__()
        self.quantize = quantize

    def forward(self, x: torch.Tensor):
        if self.quantize:
            from nanovllm.quantization.fp8_fused import silu_and_mul_quantized

            return silu_and_mul_quantized(x)
        return silu_and_mul(x)
