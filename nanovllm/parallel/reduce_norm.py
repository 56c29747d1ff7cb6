"""All-reduce, residual add and RMSNorm in one step; ``add_rms_norm``'s arithmetic
(docs/layers.md)."""

import torch
import triton
import triton.language as tl

from nanovllm.layers.layernorm import RMSNorm, add_rms_norm
from nanovllm.parallel import distributed
from nanovllm.parallel.custom_all_reduce import (
    POLL_ABORT_EVERY,
    TL_INT,
    buffer,
    next_epoch,
    push,
    sentinel,
    sum_ranks,
)


@triton.jit
def _add_rms_norm_row(s, res_ptr, w_ptr, out_ptr, sum_ptr, offs, cols, mask, eps, N: tl.constexpr):
    """Stores s + residual into ``sum_ptr`` and its RMSNorm times the weight into ``out_ptr``."""
    dtype = out_ptr.dtype.element_ty
    h = (s + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(sum_ptr + offs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (w * (hf * rstd).to(dtype).to(tl.float32)).to(dtype), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, eps, N: tl.constexpr, N_PAD: tl.constexpr
):
    # one row of x, already summed over the ranks. grid: (rows,)
    cols = tl.arange(0, N_PAD)
    mask = cols < N
    offs = tl.program_id(0).to(tl.int64) * N + cols  # (offsets past 2^31 in a large prefill)
    s = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _add_rms_norm_row(s, res_ptr, w_ptr, out_ptr, sum_ptr, offs, cols, mask, eps, N)


@triton.jit(do_not_specialize=["rows", "rank"])
def _one_shot_add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    rows,
    eps,
    data_ptrs,
    epochs,
    abort_flag,
    rank,
    slot,
    WORLD: tl.constexpr,
    COUNTERS: tl.constexpr,
    N: tl.constexpr,
    N_PAD: tl.constexpr,
    BITS: tl.constexpr,
    SENTINEL: tl.constexpr,
    POLL: tl.constexpr,
):
    # program p of P sums rows p, p + P, ..., then adds and norms them. grid: (min(rows, COUNTERS),)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = next_epoch(epochs, COUNTERS)
    half = (epoch % 2) * WORLD * slot
    cols = tl.arange(0, N_PAD)
    mask = cols < N
    for row in range(pid, rows, programs):  # (a decode step's rows: int32 offsets suffice)
        push(x_ptr, row * N + cols, mask, data_ptrs, half, rank, slot, WORLD, BITS, SENTINEL)
    own = buffer(data_ptrs, rank, BITS) + half
    for row in range(pid, rows, programs):
        offs = row * N + cols
        s = sum_ranks(x_ptr, own, offs, mask, rank, slot, abort_flag, WORLD, SENTINEL, POLL)
        s = s.to(x_ptr.dtype.element_ty).to(tl.float32)  # the all-reduce's result
        _add_rms_norm_row(s, res_ptr, w_ptr, out_ptr, sum_ptr, offs, cols, mask, eps, N)


def reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, hidden]: this rank's partial sums; returns ``add_rms_norm`` of their sum."""
    if not x.is_cuda:
        distributed.all_reduce(x)
        return add_rms_norm(x, residual, weight, eps)
    x, residual = x.contiguous(), residual.contiguous()
    rows, n = x.shape
    out, total = torch.empty_like(x), torch.empty_like(x)
    if not rows:
        return out, total
    custom = distributed.custom_all_reduce_for(x)
    n_pad = triton.next_power_of_2(n)
    warps = 8 if n >= 4096 else 4
    if custom is None:
        distributed.all_reduce(x)
        _add_rms_norm_kernel[(rows,)](
            x, residual, weight, out, total, eps, N=n, N_PAD=n_pad, num_warps=warps
        )
    else:
        bits, value = sentinel(x.dtype)
        _one_shot_add_rms_norm_kernel[(min(rows, custom.epochs.numel()),)](
            x,
            residual,
            weight,
            out,
            total,
            rows,
            eps,
            custom.data_ptrs,
            custom.epochs,
            custom.abort_flag,
            custom.rank,
            custom.slot(x),
            WORLD=custom.world,
            COUNTERS=custom.epochs.numel(),
            N=n,
            N_PAD=n_pad,
            BITS=TL_INT[bits],
            SENTINEL=value,
            POLL=POLL_ABORT_EVERY,
            num_warps=warps,
        )
    return out, total


class ReduceAddRMSNorm(RMSNorm):
    """``RMSNorm`` after a ``reduce_results=False`` layer: with a residual, x is a partial sum."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return super().forward(x)
        return reduce_add_rms_norm(x, residual, self.weight, self.eps)
