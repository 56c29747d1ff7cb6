"""Tensor-parallel linear layers. Each parameter carries a ``weight_loader`` that copies this
rank's shard of a checkpoint tensor into it."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.distributed import get_tp_rank, get_tp_size


def _divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearBase(nn.Module):
    """``tp_dim``: the weight dimension split across ranks (0: output, 1: input, None: replicated)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None:
            shard = param.size(self.tp_dim)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * shard, shard)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)


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

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        loaded = loaded.chunk(self.tp_size, dim=0)[self.tp_rank]
        param.data.narrow(0, offset, size).copy_(loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; each rank holds its query heads and its KV heads."""

    def __init__(
        self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ):
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(total_num_heads, tp_size)
        self.num_kv_heads = _divide(total_num_kv_heads, tp_size)
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        loaded = loaded.chunk(self.tp_size, dim=0)[self.tp_rank]
        param.data.narrow(0, offset, size).copy_(loaded)


class RowParallelLinear(LinearBase):
    """Splits the input features; partial results are summed with one all-reduce. The bias is
    added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(_divide(input_size, get_tp_size()), output_size, bias, tp_dim=1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is not split
            param.data.copy_(loaded)
        else:
            super().weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
