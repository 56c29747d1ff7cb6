"""``x @ W.T`` for a few rows (decode at small batch) on a GPU: one Triton kernel that streams the
weight with TMA in narrow tiles, splits K where the weight is too narrow to fill the SMs, and sums
the ranges in its last program (no second kernel). cuBLAS's choices at one row leave SMs idle on
narrow weights (BENCHMARKS.md, "Decode at batch 1")."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.layers import small_batch
from nanovllm.utils.dependent_launch import launch_options, pdl, prefetch_l2, wait_for_inputs
from nanovllm.utils.split_k import MAX_TILES, counters, sum_ranges

BLOCK_M, BLOCK_K = 16, 128  # rows padded to BLOCK_M for the tensor cores
_BLOCK_M, _BLOCK_K = tl.constexpr(BLOCK_M), tl.constexpr(BLOCK_K)


class RangeSums(NamedTuple):
    """A split call's output left for the norm behind it to add up: ``parts [splits, rows, N]``
    float32, summed in order and rounded to ``dtype`` (what the call would have stored)."""

    parts: torch.Tensor
    dtype: torch.dtype


@triton.jit(do_not_specialize=["M"])
def _rows_gemm_kernel(
    x_ptr,
    w_src,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    LEAVE_RANGES: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Program (n tile, k range); with SPLIT_K > 1 a tile's last program to arrive adds the
    ranges' float32 sums in order and sets its counter back to 0, or, with LEAVE_RANGES, each
    program stores its range's sum for the kernel behind to add."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, _BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    k_blocks = tl.cdiv(tl.cdiv(K, _BLOCK_K), SPLIT_K)
    first_kb = split * k_blocks
    last_kb = tl.minimum(first_kb + k_blocks, tl.cdiv(K, _BLOCK_K))
    if PREFETCH:  # the weights depend on no kernel before: ask for them before waiting
        first = tl.minimum(first_kb, K // _BLOCK_K - 2)
        prefetch_l2(w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn + first * _BLOCK_K)
    wait_for_inputs(PDL)
    acc = tl.zeros((_BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first_kb, last_kb):
        k = kb * _BLOCK_K + tl.arange(0, _BLOCK_K)
        x_mask = (rm < M)[:, None] & (k < K)[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        if TMA:  # out-of-bounds rows and columns read as zeros
            w = w_src.load([pid_n * BLOCK_N, kb * _BLOCK_K])
        else:
            w_mask = n_ok[:, None] & (k < K)[None, :]
            w = tl.load(w_src + rn[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    mask = (rm < M)[:, None] & n_ok[None, :]
    tile = rm[:, None] * N + rn[None, :]
    if SPLIT_K == 1:
        _store(acc, bias_ptr, out_ptr, rm, rn, n_ok, mask, stride_om, HAS_BIAS)
    elif LEAVE_RANGES:
        tl.store(partial_ptr + split * M * N + tile, acc, mask=mask)
    else:
        last, acc = sum_ranges(
            acc, partial_ptr, counter_ptr + pid_n, tile, mask, split, M * N, SPLIT_K
        )
        if last:
            _store(acc, bias_ptr, out_ptr, rm, rn, n_ok, mask, stride_om, HAS_BIAS)


@triton.jit
def _store(acc, bias_ptr, out_ptr, rm, rn, n_ok, mask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:  # added in float32 before the one rounding, as cuBLAS's epilogue
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=mask)


def choose(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, SPLIT_K, stages), from a sweep at one row on Qwen3's shapes: tiles of 32
    columns (64 past 8,192), K cut in two until 128 programs read (each range keeping at least
    two 128-wide blocks), deeper pipelines for long ranges of narrow tiles."""
    block_n = 32 if n <= 8192 else 64
    tiles, k_blocks, splits = triton.cdiv(n, block_n), triton.cdiv(k, BLOCK_K), 1
    while tiles * splits < 128 and k_blocks >= 4 * splits:
        splits *= 2
    stages = 6 if block_n == 32 and k_blocks // splits >= 16 else 4
    return block_n, splits, stages


def linear(x, weight, bias=None, out: torch.Tensor | None = None, leave_ranges: bool = False):
    """``F.linear`` (into ``out`` if given, without a bias), by ``rows_linear`` where it takes the
    call (``small_batch.takes`` rows of bf16/fp16); ``leave_ranges``: see ``rows_linear``."""
    if (
        small_batch.takes(x)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
    ):
        return rows_linear(x, weight, bias, out=out, leave_ranges=leave_ranges)
    if out is not None:
        return torch.mm(x, weight.t(), out=out)
    return torch.nn.functional.linear(x, weight, bias)


def rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    splits: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    leave_ranges: bool = False,
) -> torch.Tensor | RangeSums:
    """``x [M <= 16, K] @ weight [N, K].T (+ bias)``, into ``out`` if given (rows of unit
    stride); ``block_n``, ``splits`` and ``num_stages`` override ``choose``. ``leave_ranges``
    (no bias, no ``out``): a call that splits K returns its ranges' sums unsummed
    (``RangeSums``), for the norm behind to add."""
    (m, k), n = x.shape, weight.shape[0]
    if m > 16 or weight.shape[1] != k or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(
            "rows_linear takes x [M <= 16, K] and weight [N, K], both with contiguous rows; "
            f"got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    given = out is not None
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    auto = choose(n, k)
    block_n, splits, num_stages = block_n or auto[0], splits or auto[1], num_stages or auto[2]
    tiles = triton.cdiv(n, block_n)
    if splits > 1 and tiles > MAX_TILES:
        splits = 1
    partials = (
        torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    )
    leave_ranges = leave_ranges and splits > 1 and bias is None and not given
    tma = (  # Hopper or newer, 16-byte aligned rows, a box no larger than the weight
        x.is_cuda
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and n >= block_n
        and k >= BLOCK_K
        and k % 16 == 0
        and weight.stride(0) % 8 == 0
        and weight.data_ptr() % 16 == 0
    )
    w_src = TensorDescriptor.from_tensor(weight, [block_n, BLOCK_K]) if tma else weight
    dependent = pdl(x.device)
    _rows_gemm_kernel[(tiles, splits)](
        x,
        w_src,
        weight,
        bias if bias is not None else out,
        out,
        partials,
        counters(x.device),
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        TMA=tma,
        HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_N=block_n,
        SPLIT_K=splits,
        LEAVE_RANGES=leave_ranges,
        PDL=dependent,
        PREFETCH=dependent and tma and k % BLOCK_K == 0 and k >= 2 * BLOCK_K,
        num_warps=4,
        num_stages=num_stages,
        **launch_options(x.device),
    )
    return RangeSums(partials, x.dtype) if leave_ranges else out
