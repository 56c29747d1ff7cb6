"""Tensor-parallel linear layers. Each parameter carries a ``weight_loader`` that copies this
rank's shard of a checkpoint tensor into it.

Built under ``building_quantized("fp8")`` a layer holds FP8 weights: ``weight`` float8_e4m3fn and
``weight_scale_inv`` float32, one scale per 128x128 block of this rank's weight. Its loaders place
the scale blocks the way they place the weight (a shard or a fused part of ``size`` rows lands at
``offset``, its scales at ``offset / 128``), and a float checkpoint tensor is quantized on the way
in (``quantization="fp8"``). The bias stays in the model dtype."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.parallel.distributed import all_reduce, get_tp_rank, get_tp_size
from nanovllm.quantization import get_quantization
from nanovllm.quantization.fp8 import BLOCK, FP8_DTYPE, fp8_linear, quantize_weight_blocks


def _divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearBase(nn.Module):
    """``tp_dim``: the weight dimension split across ranks (0: output, 1: input, None: replicated).
    ``quantizable``: False keeps the layer in the model dtype in an FP8 model (MoE routers)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_dim: int | None,
        quantizable: bool = True,
    ):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.fp8 = quantizable and get_quantization() == "fp8"
        if self.fp8:
            self.weight = nn.Parameter(
                torch.empty(output_size, input_size, dtype=FP8_DTYPE), requires_grad=False
            )
            blocks = (-(-output_size // BLOCK), -(-input_size // BLOCK))
            self.weight_scale_inv = nn.Parameter(
                torch.ones(blocks, dtype=torch.float32), requires_grad=False
            )
            self.weight_scale_inv.weight_loader = self.weight_loader
            self.loaded: set[tuple] = set()  # shard ids whose weight is loaded
            self.scaled: set[tuple] = set()  # shard ids whose scales are loaded
        else:
            self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def shard(self, param: nn.Parameter, *shard_id) -> tuple[int, int, int]:
        """(offset in ``param``, offset in the checkpoint tensor, size) along ``tp_dim`` of this
        rank's part of a checkpoint tensor (of part ``shard_id`` in a fused layer)."""
        size = param.size(self.tp_dim)
        return 0, self.tp_rank * size, size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        if self.fp8 and param is self.weight:
            if loaded.dtype != FP8_DTYPE:  # a float tensor: quantized here
                loaded, scale = quantize_weight_blocks(loaded.to(param.device))
                self._copy(self.weight_scale_inv, scale, shard_id)
                self.scaled.add(shard_id)
            self.loaded.add(shard_id)
        elif self.fp8 and param is self.weight_scale_inv:
            self.scaled.add(shard_id)
        self._copy(param, loaded, shard_id)

    def _copy(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple) -> None:
        if (
            self.tp_dim is None or param.dim() == 1 and self.tp_dim == 1
        ):  # replicated, or a row-parallel bias
            param.data.copy_(loaded)
            return
        block = BLOCK if self.fp8 and param is self.weight_scale_inv else 1
        dst, src, size = self.shard(self.weight if block > 1 else param, *shard_id)
        # in scale blocks, a part's size rounds up: only the last part of a dimension may end in a partial block
        dst, src, size = dst // block, src // block, -(-size // block)
        param.data.narrow(self.tp_dim, dst, size).copy_(loaded.narrow(self.tp_dim, src, size))

    def missing(self) -> list[str]:
        """FP8 weights loaded without their ``weight_scale_inv`` (see ``load_model``)."""
        if not self.fp8:
            return []
        return [
            f"weight_scale_inv{' (' + ', '.join(map(str, s)) + ')' if s else ''}"
            for s in self.loaded - self.scaled
        ]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8:
            return fp8_linear(x, self.weight, self.weight_scale_inv, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, quantizable: bool = True
    ):
        super().__init__(input_size, output_size, bias, tp_dim=None, quantizable=quantizable)


class ColumnParallelLinear(LinearBase):
    """Splits the output features; each rank produces its slice (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, _divide(output_size, get_tp_size()), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused in one weight (e.g. gate and up); the
    checkpoint holds them separately, loaded by index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def shard(self, param: nn.Parameter, shard_id: int) -> tuple[int, int, int]:
        size = self.output_sizes[shard_id] // self.tp_size
        return sum(self.output_sizes[:shard_id]) // self.tp_size, self.tp_rank * size, size


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; each rank holds its query heads and its KV heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ):
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(total_num_heads, tp_size)
        self.num_kv_heads = _divide(total_num_kv_heads, tp_size)
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def shard(self, param: nn.Parameter, shard_id: str) -> tuple[int, int, int]:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            shard_id
        ]
        return offset, self.tp_rank * size, size


class RowParallelLinear(LinearBase):
    """Splits the input features; partial results are summed with one all-reduce. The bias is
    added once, after the reduction. ``reduce_results = False`` (set by a model, only without a
    bias) returns this rank's partial results for the layer behind it to sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(_divide(input_size, get_tp_size()), output_size, bias, tp_dim=1)
        self.reduce_results = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, None)
        if self.tp_size > 1 and self.reduce_results:
            all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
