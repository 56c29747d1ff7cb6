"""``x @ W.T`` for a few rows (decode at small batch) on a GPU: one Triton kernel that streams the
weight with TMA, splits K so every SM reads, and sums the ranges in its last program (no second
kernel); ``gated`` reads ``[gate | up]`` rows and multiplies by ``silu(gate) * up`` on the way in.
cuBLAS picks tiles for larger batches and leaves SMs idle on these shapes (docs/kernels.md)."""

import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.utils.dependent_launch import launch_options, pdl, prefetch_l2, wait_for_inputs

MAX_ROWS = 16  # more rows go to cuBLAS
# NANOVLLM_ROWS_GEMM=0: every linear calls F.linear (benchmarks compare the two)
ENABLED = os.environ.get("NANOVLLM_ROWS_GEMM", "1") != "0"
BLOCK_M, BLOCK_K = 16, 128
MAX_TILES = 4096  # output tiles a call may have (one arrival counter each)


@triton.jit
def _load_rows(x_ptr, rm, k, M, K, stride_xm, GATED: tl.constexpr):
    mask = (rm < M)[:, None] & (k < K)[None, :]
    offsets = rm[:, None] * stride_xm + k[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if GATED:  # [gate | up]: silu(gate) * up in float32, rounded once
        up = tl.load(x_ptr + K + offsets, mask=mask, other=0.0).to(tl.float32)
        gate = x.to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up).to(x.dtype)
    return x


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
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Program (n tile, k range); with SPLIT_K > 1 a tile's last program to arrive adds the
    ranges' float32 sums in order and sets its counter back to 0."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, 16)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    k_blocks = tl.cdiv(tl.cdiv(K, 128), SPLIT_K)
    first_kb = split * k_blocks
    last_kb = tl.minimum(first_kb + k_blocks, tl.cdiv(K, 128))
    if PREFETCH:  # the weights depend on no kernel before: ask for them before waiting
        first = tl.minimum(first_kb, K // 128 - 2)
        prefetch_l2(w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn + first * 128)
    wait_for_inputs(PDL)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for kb in range(first_kb, last_kb):
        k = kb * 128 + tl.arange(0, 128)
        x = _load_rows(x_ptr, rm, k, M, K, stride_xm, GATED)
        if TMA:  # out-of-bounds rows and columns read as zeros
            w = w_src.load([pid_n * BLOCK_N, kb * 128])
        else:
            w_mask = n_ok[:, None] & (k < K)[None, :]
            w = tl.load(w_src + rn[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    mask = (rm < M)[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        _store(acc, bias_ptr, out_ptr, rm, rn, n_ok, mask, stride_om, HAS_BIAS)
    else:
        tile = rm[:, None] * N + rn[None, :]
        tl.store(partial_ptr + split * M * N + tile, acc, mask=mask)
        tl.debug_barrier()  # the whole range's sum is written before the count releases it
        if tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # from L2 (".cg"): other SMs wrote them
                partial = partial_ptr + s * M * N + tile
                acc += tl.load(partial, mask=mask, other=0.0, cache_modifier=".cg")
            _store(acc, bias_ptr, out_ptr, rm, rn, n_ok, mask, stride_om, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next call or graph replay


@triton.jit
def _store(acc, bias_ptr, out_ptr, rm, rn, n_ok, mask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:  # added in float32 before the one rounding, as cuBLAS's epilogue
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=mask)


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: choose as on an H100
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose(n: int, k: int, sms: int) -> tuple[int, int]:
    """(BLOCK_N, SPLIT_K): tiles of 64 columns (32 for narrow weights), K cut into power-of-two
    ranges of at least two 128-wide blocks until about two programs per SM read."""
    block_n = 64 if n >= 1024 else 32
    tiles, k_blocks, splits = triton.cdiv(n, block_n), triton.cdiv(k, 128), 1
    while tiles * splits < 2 * sms and k_blocks >= 4 * splits and splits < 16:
        splits *= 2
    return block_n, splits


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rows_linear`` takes this call (the caller falls back to F.linear)."""
    return (
        ENABLED
        and x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    block_n: int | None = None,
    splits: int | None = None,
    num_stages: int = 4,
) -> torch.Tensor:
    """``x [M <= 16, K] @ weight [N, K].T (+ bias)``; ``gated``: x is ``[M, 2K]`` = [gate | up]
    and the product is ``(silu(gate) * up) @ weight.T``. ``block_n``/``splits`` override
    ``choose``."""
    m, n = x.shape[0], weight.shape[0]
    k = x.shape[1] // 2 if gated else x.shape[1]
    if m > MAX_ROWS or weight.shape[1] != k or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(
            f"rows_linear takes x [M <= {MAX_ROWS}, K{' * 2' if gated else ''}] and weight "
            f"[N, K], both with contiguous rows; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    auto_n, auto_splits = choose(n, k, _sm_count(x.device))
    block_n, splits = block_n or auto_n, splits or auto_splits
    tiles = triton.cdiv(n, block_n)
    if splits > 1 and tiles > MAX_TILES:
        splits = 1
    partials = (
        torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    )
    tma = (
        x.is_cuda
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
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
        _counters(x.device),
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        TMA=tma,
        GATED=gated,
        HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_N=block_n,
        SPLIT_K=splits,
        PDL=dependent,
        PREFETCH=dependent and tma and k % BLOCK_K == 0 and k >= 2 * BLOCK_K,
        num_warps=4,
        num_stages=num_stages,
        **launch_options(x.device),
    )
    return out
