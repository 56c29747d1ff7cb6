"""Gated DeltaNet, the linear-attention layer of Qwen3.5: projections over the whole step, then the
conv and the delta rule with each sequence's carried states: on a GPU over the whole step in Triton
kernels (``gpu_step.py``), elsewhere per sequence in torch ops (``ops.py``)."""

import torch
from torch import nn

from nanovllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from nanovllm.layers.linear_attention.ops import (
    causal_conv,
    decay_and_beta,
    gated_delta_rule,
    gated_rms_norm,
)
from nanovllm.layers.linear_attention.states import StateBatch, get_state_batch
from nanovllm.parallel.distributed import get_tp_rank, get_tp_size


def _parts_loader(sizes: list[int], param: nn.Parameter, loaded: torch.Tensor) -> None:
    """This rank's slice of each of the consecutive parts ``sizes`` (full sizes) along dim 0."""
    tp_size, rank = get_tp_size(), get_tp_rank()
    dst = src = 0
    for size in sizes:
        local = size // tp_size
        part = loaded.narrow(0, src + rank * local, local)
        param.data.narrow(0, dst, local).copy_(part)
        dst, src = dst + local, src + size


class SplitColumnLinear(MergedColumnParallelLinear):
    """Column-parallel linear whose one checkpoint tensor holds consecutive parts (q, k, v), each
    split across ranks."""

    def checkpoint_shape(self, param: nn.Parameter, *shard_id) -> tuple[int, ...]:
        return (sum(self.output_sizes), *param.shape[1:])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        _parts_loader(self.output_sizes, param, loaded)


class DepthwiseConvWeight(nn.Module):
    """``weight`` [C, 1, W] of the causal conv (the checkpoint's ``conv1d.weight``)."""

    def __init__(self, sizes: list[int], kernel: int):
        super().__init__()
        self.sizes = sizes
        self.weight = nn.Parameter(torch.empty(sum(sizes) // get_tp_size(), 1, kernel))
        self.weight.weight_loader = lambda param, loaded: _parts_loader(sizes, param, loaded)

    def checkpoint_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        return (sum(self.sizes), *param.shape[1:])


def _check_divisible(config, tp_size: int) -> None:
    for name in ("linear_num_key_heads", "linear_num_value_heads"):
        value = getattr(config, name)
        if value % tp_size:
            msg = f"allowed: a multiple of tensor_parallel_size {tp_size}"
            raise ValueError(f"{name} is {value}; {msg}")
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    if hv % hk:
        msg = f"allowed: a multiple of linear_num_key_heads {hk}"
        raise ValueError(f"linear_num_value_heads is {hv}; {msg}")


class GatedDeltaNet(nn.Module):
    """The runner sets ``conv_states`` [slots, C, W-1] (model dtype) and ``recurrent_states``
    [slots, Hv, Dk, Dv] (float32), shapes from ``state_shapes()``, and the step's sequences
    (``states.state_batch``). Without sequences, all rows are one fresh sequence."""

    def __init__(self, config):
        super().__init__()
        tp_size = get_tp_size()
        _check_divisible(config, tp_size)
        hidden = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads // tp_size
        self.num_v_heads = config.linear_num_value_heads // tp_size
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        key_dim = config.linear_num_key_heads * self.head_k_dim
        value_dim = config.linear_num_value_heads * self.head_v_dim
        sizes = [key_dim, key_dim, value_dim]
        self.in_proj_qkv = SplitColumnLinear(hidden, sizes)
        self.in_proj_z = ColumnParallelLinear(hidden, value_dim)
        self.in_proj_b = ColumnParallelLinear(hidden, config.linear_num_value_heads)
        self.in_proj_a = ColumnParallelLinear(hidden, config.linear_num_value_heads)
        self.conv1d = DepthwiseConvWeight(sizes, self.kernel)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        for param in (self.dt_bias, self.A_log):
            param.weight_loader = self._head_loader
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(self.head_v_dim))
        self.out_proj = RowParallelLinear(value_dim, hidden)
        self.conv_states = torch.tensor([])
        self.recurrent_states = torch.tensor([])

    def _head_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = self.num_v_heads
        param.data.copy_(loaded.narrow(0, get_tp_rank() * n, n))

    def checkpoint_shape(self, param: nn.Parameter) -> tuple[int, ...]:  # dt_bias, A_log
        return (self.num_v_heads * get_tp_size(),)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """((C, W-1), (Hv, Dk, Dv)) of one slot, this rank's heads."""
        conv = (self.conv1d.weight.shape[0], self.kernel - 1)
        return conv, (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(mixed [T, q|k|v], z [T, Hv*Dv], a [T, Hv], b [T, Hv])``, this rank's heads."""
        mixed, z = self.in_proj_qkv(hidden), self.in_proj_z(hidden)
        return mixed, z, self.in_proj_a(hidden), self.in_proj_b(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; rows no sequence of the batch covers give zeros."""
        t = hidden.shape[0]
        mixed, z, a, b = self.project(hidden)
        batch, conv_states, states = get_state_batch(), self.conv_states, self.recurrent_states
        if batch.tensors is not None and hidden.is_cuda:  # the whole step in Triton kernels
            from nanovllm.layers.linear_attention.gpu_step import mix_step

            return self.out_proj(mix_step(self, mixed, z, a, b, batch))
        g, beta = decay_and_beta(a, b, self.A_log, self.dt_bias)
        if not batch.starts:  # standalone: one fresh sequence, temporary states
            batch = StateBatch([0], [t], [0], [True])
            conv_shape, state_shape = self.state_shapes()
            conv_states = hidden.new_zeros(1, *conv_shape)
            states = torch.zeros(1, *state_shape, dtype=torch.float32, device=hidden.device)
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        weight = self.conv1d.weight[:, 0]
        out = hidden.new_zeros(t, hv, dv)
        for start, n, slot, fresh in zip(batch.starts, batch.lens, batch.slots, batch.fresh):
            if n == 0:
                continue
            rows = slice(start, start + n)
            x = causal_conv(mixed[rows], weight, conv_states[slot], fresh)
            q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
            q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
            out[rows] = gated_delta_rule(q, k, v, g[rows], beta[rows], states[slot], fresh)
        o = out.reshape(t * hv, dv)
        o = gated_rms_norm(o, z.reshape(t * hv, dv), self.norm.weight, self.eps)
        return self.out_proj(o.reshape(t, hv * dv))
