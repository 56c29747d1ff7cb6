"""FP8 weights as a quantization method (docs/quantization.md)."""

from functools import partial

import torch
from torch import nn

from nanovllm.layers.linear import LinearBase, LinearMethod
from nanovllm.quantization.fp8 import fp8_linear, quantize_weight_blocks
from nanovllm.quantization.fp8_fused import QuantizedRMSNorm, QuantizedSiluAndMul
from nanovllm.quantization.fp8_types import BLOCK, FP8_DTYPE


class Fp8LinearMethod(LinearMethod):
    """Scale blocks placed like the weight; float tensors quantized on load."""

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int) -> None:
        weight = torch.empty(output_size, input_size, dtype=FP8_DTYPE)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        blocks = (-(-output_size // BLOCK), -(-input_size // BLOCK))
        scale = nn.Parameter(torch.ones(blocks, dtype=torch.float32), requires_grad=False)
        layer.weight_scale_inv = scale
        layer.weight.weight_loader = scale.weight_loader = partial(self.load, layer)
        scale.checkpoint_shape = partial(self.scale_shape, layer)
        scale.derived = True  # a float weight's loader fills it too
        layer.loaded, layer.scaled = set(), set()  # shard ids whose weight / scales are loaded

    def load(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, *shard_id):
        if param is layer.weight:
            if loaded.dtype != FP8_DTYPE:  # a float tensor: quantized here
                loaded, scale = quantize_weight_blocks(loaded.to(param.device))
                layer.copy_shard(layer.weight_scale_inv, scale, shard_id, BLOCK)
                layer.scaled.add(shard_id)
            layer.loaded.add(shard_id)
            layer.copy_shard(param, loaded, shard_id)
        else:
            layer.scaled.add(shard_id)
            layer.copy_shard(param, loaded, shard_id, BLOCK)

    def scale_shape(self, layer: LinearBase, param: nn.Parameter, *shard_id) -> tuple[int, ...]:
        return tuple(-(-n // BLOCK) for n in layer.checkpoint_shape(layer.weight, *shard_id))

    def missing(self, layer: LinearBase) -> list[str]:
        """Weights loaded without their ``weight_scale_inv``."""
        return [
            f"weight_scale_inv{' (' + ', '.join(map(str, s)) + ')' if s else ''}"
            for s in layer.loaded - layer.scaled
        ]

    def apply(self, layer: LinearBase, x, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale_inv, bias)


class Fp8Config:
    """What an FP8 model builds: FP8 linears and ops quantizing for them."""

    name = "fp8"

    def __init__(self):
        self._linear = Fp8LinearMethod()

    def linear_method(self) -> Fp8LinearMethod:
        return self._linear

    def norm(self, hidden_size: int, eps: float, reduces_input: bool) -> QuantizedRMSNorm:
        return QuantizedRMSNorm(hidden_size, eps, reduces_input)

    def activation(self) -> QuantizedSiluAndMul:
        return QuantizedSiluAndMul()

    def quantizes_attention_output(self, head_dim: int) -> bool:
        return head_dim == BLOCK
