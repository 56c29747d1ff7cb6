"""Tensor-parallel linear layers; weights and GEMM belong to the layer's ``quant_method``."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers import small_batch
from nanovllm.parallel.distributed import all_reduce, get_tp_rank, get_tp_size


def _divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearMethod:
    """Plain weights and ``F.linear`` in the model dtype."""

    def create_weights(self, layer: "LinearBase", input_size: int, output_size: int) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size))
        layer.weight.weight_loader = layer.weight_loader

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None):
        if small_batch.takes(x):
            from nanovllm.layers.rows_gemm import linear

            return linear(x, layer.weight, bias, leave_ranges=layer.leaves_ranges)
        return F.linear(x, layer.weight, bias)

    def missing(self, layer: "LinearBase") -> list[str]:  # unloaded after load_model
        return []


class LinearBase(nn.Module):
    """``tp_dim``: the weight dimension split across ranks (0: output, 1: input, None: none)."""

    leaves_ranges = False  # True where an RMSNorm reads the output (rows_gemm.RangeSums)

    def __init__(self, input_size, output_size, bias: bool, tp_dim: int | None, quant_method=None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.quant_method = quant_method or LinearMethod()
        self.quant_method.create_weights(self, input_size, output_size)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def shard(self, param: nn.Parameter, *shard_id) -> tuple[int, int, int]:
        """(offset in ``param``, offset in the checkpoint tensor, size) of this rank's part."""
        size = param.size(self.tp_dim)
        return 0, self.tp_rank * size, size

    def _replicated(self, param: nn.Parameter) -> bool:  # or a row-parallel bias
        return self.tp_dim is None or param.dim() == 1 and self.tp_dim == 1

    def checkpoint_shape(self, param: nn.Parameter, *shard_id) -> tuple[int, ...]:
        shape = list(param.shape)
        if not self._replicated(param):
            shape[self.tp_dim] = self.shard(param, *shard_id)[2] * self.tp_size
        return tuple(shape)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        self.copy_shard(param, loaded, shard_id)

    def copy_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple, block=1):
        """This rank's part of ``loaded`` into ``param``, one value per ``block`` weights along
        ``tp_dim``."""
        if self._replicated(param):
            param.data.copy_(loaded)
            return
        dst, src, size = self.shard(self.weight if block > 1 else param, *shard_id)
        dst, src, size = dst // block, src // block, -(-size // block)
        param.data.narrow(self.tp_dim, dst, size).copy_(loaded.narrow(self.tp_dim, src, size))

    def missing(self) -> list[str]:
        return self.quant_method.missing(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None):
        super().__init__(input_size, output_size, bias, None, quant_method)


class ColumnParallelLinear(LinearBase):
    """Splits the output features; each rank produces its slice."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None):
        tp_size = get_tp_size()
        super().__init__(input_size, _divide(output_size, tp_size), bias, 0, quant_method)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel gate and up in one weight, loaded by index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias=False, quant_method=None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, quant_method)

    def shard(self, param: nn.Parameter, shard_id: int) -> tuple[int, int, int]:
        size = self.output_sizes[shard_id] // self.tp_size
        return sum(self.output_sizes[:shard_id]) // self.tp_size, self.tp_rank * size, size


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size, head_dim, heads, kv_heads, bias=False, quant_method=None):
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(heads, tp_size)
        self.num_kv_heads = max(1, kv_heads // tp_size)  # fewer KV heads than ranks: replicated
        self.kv_replicas = tp_size * self.num_kv_heads // kv_heads  # ranks holding each KV head
        output_size = (heads + 2 * self.num_kv_heads * tp_size) * head_dim
        super().__init__(hidden_size, output_size, bias, quant_method)

    def shard(self, param: nn.Parameter, shard_id: str) -> tuple[int, int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        return offset, self.tp_rank // (1 if shard_id == "q" else self.kv_replicas) * size, size

    def checkpoint_shape(self, param: nn.Parameter, *shard_id) -> tuple[int, ...]:
        shape = list(super().checkpoint_shape(param, *shard_id))
        shape[0] //= 1 if shard_id == ("q",) else self.kv_replicas
        return tuple(shape)


class RowParallelLinear(LinearBase):
    """``reduce_results=False`` (no bias): the norm behind it sums the ranks' parts."""

    def __init__(self, input_size, output_size, bias=False, quant_method=None, reduce_results=True):
        tp_size = get_tp_size()
        super().__init__(_divide(input_size, tp_size), output_size, bias, 1, quant_method)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, None)
        if self.tp_size > 1 and self.reduce_results:
            all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
