"""``fp8.fp8_linear`` on the GPU: a Triton GEMM with split-K, or cuBLAS's from
``fp8_cublas.MIN_ROWS`` rows (docs/quantization.md)."""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.quantization import fp8_cublas
from nanovllm.quantization.fp8_rows import quantize_rows
from nanovllm.quantization.fp8_types import BLOCK, QuantizedRows
from nanovllm.utils.dependent_launch import launch_options, pdl, prefetch_l2, wait_for_inputs
from nanovllm.utils.split_k import MAX_TILES, counters, sum_ranges

_BLOCK_K = tl.constexpr(BLOCK)
PRECISE = False  # the default of fp8_linear_triton's ``precise`` (tests comparing exactly set it)
PREFETCH_WEIGHTS = True  # see _fp8_gemm_kernel


class GemmTile(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8


@triton.jit(do_not_specialize=["M", "stride_xsk"])
def _fp8_gemm_kernel(
    q_src,
    xs_ptr,
    w_src,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_qm,
    stride_xsk,
    stride_wn,
    stride_wsn,
    stride_om,
    TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """``q_src``/``w_src``: TMA descriptors (``TMA``) or pointers; BLOCK_N divides 128. With
    SPLIT_K > 1 a tile's last program adds the partial sums in order and zeroes its counter."""
    # programs of one group of GROUP_M token tiles walk the same weight tiles together (L2 reuse)
    pid, tiles_m, tiles_n = tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_size
    pid_n = (pid % (GROUP_M * tiles_n)) // group_size
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, _BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    w_scales = ws_ptr + (pid_n * BLOCK_N // _BLOCK_K) * stride_wsn  # this tile's weight scales
    k_blocks = tl.cdiv(tl.cdiv(K, _BLOCK_K), SPLIT_K)  # per range
    first_kb = tl.program_id(1) * k_blocks
    last_kb = tl.minimum(first_kb + k_blocks, tl.cdiv(K, _BLOCK_K))
    if PREFETCH:  # a hint that reads nothing, so it may come before the wait
        first = tl.minimum(first_kb, K // _BLOCK_K - 2)  # (an empty range's reads stay in its rows)
        prefetch_l2(w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn + first * _BLOCK_K)
    wait_for_inputs(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first_kb, last_kb):
        if TMA:  # out-of-bounds rows and columns read as zeros
            q = q_src.load([pid_m * BLOCK_M, kb * _BLOCK_K])
            w = w_src.load([pid_n * BLOCK_N, kb * _BLOCK_K])
        else:
            k = kb * _BLOCK_K + rk
            q = tl.load(
                q_src + rm[:, None] * stride_qm + k[None, :],
                mask=m_ok[:, None] & (k < K)[None, :],
                other=0.0,
            )
            w = tl.load(
                w_src + rn[:, None] * stride_wn + k[None, :],
                mask=n_ok[:, None] & (k < K)[None, :],
                other=0.0,
            )
        if PRECISE:  # every MMA's result added in float32
            partial = tl.dot(q, tl.trans(w), out_dtype=tl.float32, max_num_imprecise_acc=0)
        else:
            partial = tl.dot(q, tl.trans(w), out_dtype=tl.float32)
        # activation scale x weight scale: a vector over the tile's rows
        scale = tl.load(xs_ptr + kb * stride_xsk + rm, mask=m_ok, other=0.0) * tl.load(
            w_scales + kb
        )
        acc += partial * scale[:, None]
    if SPLIT_K == 1:
        _store_tile(acc, bias_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_om, HAS_BIAS)
    else:
        mask = m_ok[:, None] & n_ok[None, :]
        tile = rm[:, None] * N + rn[None, :]
        split = tl.program_id(1)
        last, acc = sum_ranges(
            acc, partial_ptr, counter_ptr + pid, tile, mask, split, M * N, SPLIT_K
        )
        if last:
            _store_tile(acc, bias_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_om, HAS_BIAS)


@triton.jit
def _store_tile(acc, bias_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_om, HAS_BIAS: tl.constexpr):
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_BIAS:  # added after the cast, as the torch path does (the sum rounded once)
        bias = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + bias[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :]
    )


@functools.cache
def _has_tma(device: torch.device) -> bool:
    # Hopper or newer; the Triton interpreter emulates descriptors
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 1
    )


def tile(num_tokens: int) -> GemmTile:
    if num_tokens <= 16:  # 4 stages, not 6: up to 1.4 us less at one row (BENCHMARKS.md)
        return GemmTile(16, 64, 4, 4)
    if num_tokens <= 32:
        return GemmTile(32, 64, 4, 5)
    if num_tokens <= 64:
        return GemmTile(64, 64, 4, 4)
    if num_tokens <= 256:
        return GemmTile(64, 128, 4, 4)
    if num_tokens <= 512:
        return GemmTile(64, 128, 4, 3)
    return GemmTile(128, 128, 8, 4)


def split_k(num_tokens: int, k: int, tiles: int, sms: int) -> int:
    """k ranges (a power of two up to 8): more where few output tiles would leave SMs idle."""
    splits = 1
    while (more := 2 * splits) <= 8 and tiles * more <= 3 * sms and 8 * more * num_tokens <= k / 3:
        splits = more
    return splits


def fp8_linear_triton(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    precise: bool | None = None,
    gemm_tile: GemmTile | None = None,
    splits: int | None = None,
    cublas: bool | None = None,
) -> torch.Tensor:
    """``fp8.fp8_linear`` on CUDA. ``precise``: float32 accumulation inside k-blocks too;
    ``gemm_tile``, ``splits`` and ``cublas`` override the choices of ``tile``, ``split_k`` and
    ``fp8_cublas.usable``."""
    if isinstance(x, QuantizedRows):
        q, x_scale, m, dtype = x
        lead, k = (m,), q.shape[1]
    else:
        lead, k, dtype = x.shape[:-1], x.shape[-1], x.dtype
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        q, m = None, x2.shape[0]
    n = weight.shape[0]
    out_dtype = out_dtype or dtype
    precise = PRECISE if precise is None else precise
    if cublas is None:  # (rows quantized elsewhere must come padded for it)
        cublas = (
            not precise
            and gemm_tile is None
            and splits is None
            and fp8_cublas.usable(m, weight, out_dtype)
            and (q is None or q.shape[0] % fp8_cublas.ROW_MULTIPLE == 0)
        )
    if cublas:
        if q is None:
            q, x_scale = quantize_rows(x2, fp8_cublas.ROW_MULTIPLE)
        out = fp8_cublas.gemm(q, x_scale, weight, weight_scale)[:m]
        return (out if bias is None else out + bias).view(*lead, n)
    out = torch.empty(m, n, dtype=out_dtype, device=weight.device)
    if m:
        if q is None:
            q, x_scale = quantize_rows(x2)
        t = gemm_tile or tile(m)
        tiles = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
        splits = (
            (splits or split_k(m, k, tiles, _sm_count(weight.device))) if tiles <= MAX_TILES else 1
        )
        arrivals = counters(weight.device)
        partials = (
            torch.empty(splits, m, n, dtype=torch.float32, device=weight.device)
            if splits > 1
            else out
        )
        # TMA (Hopper+) needs 16-byte aligned rows: K a multiple of 16, as in every Qwen shape
        tma = (
            _has_tma(weight.device)
            and k % 16 == 0
            and weight.stride(-1) == 1
            and weight.stride(0) % 16 == 0
            and weight.data_ptr() % 16 == 0
        )
        q_src = TensorDescriptor.from_tensor(q, [t.block_m, BLOCK]) if tma else q
        w_src = TensorDescriptor.from_tensor(weight, [t.block_n, BLOCK]) if tma else weight
        dependent = pdl(weight.device)
        _fp8_gemm_kernel[(tiles, splits)](
            q_src,
            x_scale,
            w_src,
            weight,
            weight_scale,
            bias if bias is not None else out,
            out,
            partials,
            arrivals,
            m,
            n,
            k,
            q.stride(0),
            x_scale.stride(0),
            weight.stride(0),
            weight_scale.stride(0),
            out.stride(0),
            TMA=tma,
            HAS_BIAS=bias is not None,
            PRECISE=precise,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            GROUP_M=t.group_m,
            SPLIT_K=splits,
            PDL=dependent,
            PREFETCH=dependent and PREFETCH_WEIGHTS and tma and k % BLOCK == 0 and k >= 2 * BLOCK,
            num_warps=t.num_warps,
            num_stages=t.num_stages,
            **launch_options(weight.device),
        )
    return out.view(*lead, n)
