"""The Triton attention backend: checks shapes, picks tiles and split counts, launches the kernels
of ``triton_prefill.py`` and ``triton_decode.py`` on a cache in the model's dtype or FP8."""

import functools
import math

import torch
import triton
import triton.language as tl

from nanovllm.layers.attention.fp8_kv import FP8_DTYPE
from nanovllm.layers.attention.interface import AttentionBackend
from nanovllm.layers.attention.triton_decode import _decode_kernel
from nanovllm.layers.attention.triton_kernels import LOG2E
from nanovllm.layers.attention.triton_prefill import _prefill_kernel
from nanovllm.layers.attention.triton_tiles import (
    MAX_TABLE_IN_REGISTERS,
    DecodeTile,
    decode_tiles,
    prefill_tiles,
)
from nanovllm.quantization.fp8_cublas import ROW_MULTIPLE
from nanovllm.quantization.fp8_rows import empty_quantized
from nanovllm.quantization.fp8_types import BLOCK, QuantizedRows
from nanovllm.utils.context import Context
from nanovllm.utils.dependent_launch import launch_options, pdl


@functools.cache
def _split_counters(device: torch.device) -> torch.Tensor:
    """One arrival counter per (row, KV head) of a split decode; splits stop below
    PROGRAMS_PER_SM x SMs programs, far fewer."""
    return torch.zeros(1 << 16, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the Triton interpreter on the CPU: any small number exercises the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(
            f"the Triton attention kernels need head_dim to be a power of two >= 16, got {head_dim}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have the same strides and contiguous rows")
    if q.stride(-1) != 1:
        raise ValueError("q must have contiguous rows (stride 1 in head_dim)")


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (decode: the rows)


def _fp8_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
):
    """(fp8, k_scale, v_scale, scale strides, DOT_DTYPE); False and Nones for a cache in the
    model's dtype, which compile the plain kernel."""
    if k_cache.dtype != FP8_DTYPE:
        return False, None, None, (None, None, None), None
    if k_scale is None or v_scale is None:
        raise ValueError("an FP8 KV cache needs k_scale and v_scale")
    if k_scale.stride() != v_scale.stride() or k_scale.shape != k_cache.shape[:3]:
        raise ValueError(
            "k_scale and v_scale must be [num_blocks, block_size, num_kv_heads] "
            "with the same strides"
        )
    # float32 for a float32 model, else float16 (e4m3 converts to it exactly; docs/attention.md)
    dot_dtype = tl.float32 if q.dtype == torch.float32 else tl.float16
    return True, k_scale, v_scale, k_scale.stride(), dot_dtype


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    quantizes_output = True

    MIN_TILES_PER_SPLIT = 4  # split-K only where each split still has this many key tiles to read
    PROGRAMS_PER_SM = 2  # split-K until the launch has this many programs per SM

    def __init__(self, num_splits: int | None = None, decode_tile: DecodeTile | None = None):
        """``num_splits``: decode key splits per sequence (a power of two; None: by shapes and SM
        count). ``decode_tile``: overrides ``decode_tiles``' choice."""
        if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
            raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
        self.num_splits = num_splits
        self.decode_tile = decode_tile

    def prefill(
        self, q, k, v, k_cache, v_cache, context: Context, scale, k_scale=None, v_scale=None
    ):
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        paged = context.block_tables is not None
        if paged:
            _check_shapes(q, k_cache, v_cache)
            num_kv_heads = k_cache.shape[2]
        elif k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("k and v must have contiguous rows (stride 1 in head_dim)")
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        num_seqs = context.cu_seqlens_q.numel() - 1
        if num_tokens == 0 or num_seqs == 0:
            return out
        block_m, block_n, num_warps, num_stages = prefill_tiles(
            head_dim, q.element_size(), context.max_seqlen_q
        )
        # without a paged cache these arguments are unused; pass q so every pointer is valid
        k_cache_arg, v_cache_arg, tables = (
            (k_cache, v_cache, context.block_tables) if paged else (q, q, q)
        )
        cache_strides = k_cache.stride()[:3] if paged else (0, 0, 0)
        fp8, k_scale_arg, v_scale_arg, scale_strides, dot_dtype = _fp8_args(
            q, k_cache_arg, k_scale, v_scale
        )
        grid = (triton.cdiv(context.max_seqlen_q, block_m), num_seqs, num_heads)
        _prefill_kernel[grid](
            q,
            k,
            v,
            out,
            k_cache_arg,
            v_cache_arg,
            tables,
            context.cu_seqlens_q,
            context.cu_seqlens_k,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            out.stride(0),
            out.stride(1),
            *cache_strides,
            tables.stride(0) if paged else 0,
            scale * LOG2E,
            k_scale_arg,
            v_scale_arg,
            *scale_strides,
            GROUP=num_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=k_cache.shape[1] if paged else 1,
            PAGED=paged,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            FP8=fp8,
            DOT_DTYPE=dot_dtype,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        return out

    def decode(
        self,
        q,
        k_cache,
        v_cache,
        context: Context,
        scale,
        k_scale=None,
        v_scale=None,
        quantize=False,
    ):
        """CUDA-graph safe: no host syncs, the split count depends only on shapes."""
        _check_shapes(q, k_cache, v_cache)
        num_seqs, num_heads, head_dim = q.shape
        if quantize and head_dim != BLOCK:
            raise ValueError(
                f"a quantized decode output needs head_dim {BLOCK} (one group per head), "
                f"got {head_dim}"
            )
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        group = num_heads // num_kv_heads
        group_pad = max(16, triton.next_power_of_2(group))
        fp8, k_scale, v_scale, scale_strides, dot_dtype = _fp8_args(q, k_cache, k_scale, v_scale)
        tile = self.decode_tile or DecodeTile(
            *decode_tiles(head_dim, q.element_size(), group_pad, fp8)
        )
        tables = context.block_tables
        if quantize:  # only quantized rows are stored; ``out`` (q) gives the dtype to round to
            out = q
            m_out, qo, qo_scales = empty_quantized(
                num_seqs, num_heads * head_dim, ROW_MULTIPLE, q.device
            )
        else:
            out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
            m_out, qo, qo_scales = num_seqs, out, out  # (unused)
        if num_seqs == 0:
            return QuantizedRows(qo, qo_scales, num_seqs, q.dtype) if quantize else out
        width = tables.shape[1]
        in_registers = block_size % tile.block_n == 0 and width <= MAX_TABLE_IN_REGISTERS
        table_pad = triton.next_power_of_2(width) if in_registers else 0
        num_splits = self.num_splits or self._pick_num_splits(
            num_seqs * num_kv_heads, width * block_size, tile.block_n, q.device
        )
        rows = m_out if quantize else num_seqs  # the program writing a row runs for padding too
        if rows > MAX_GRID_Y:
            msg = f"a decode of {rows} rows needs more than a launch grid's {MAX_GRID_Y}"
            raise ValueError(f"{msg}; lower max_num_seqs")
        if num_splits == 1:
            part_acc = part_ml = counters = out  # unused
        else:
            part_acc = torch.empty(
                rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
            )
            part_ml = torch.empty(
                2, rows, num_heads, num_splits, dtype=torch.float32, device=q.device
            )
            counters = _split_counters(q.device)
            if rows * num_kv_heads > counters.numel():
                msg = f"a split decode of {rows} rows x {num_kv_heads} KV heads needs more than"
                raise ValueError(f"{msg} the {counters.numel()} arrival counters")
        _decode_kernel[(num_kv_heads, rows, num_splits)](
            q,
            out,
            part_acc,
            part_ml,
            counters,
            k_cache,
            v_cache,
            tables,
            context.context_lens,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            *k_cache.stride()[:3],
            tables.stride(0),
            scale * LOG2E,
            k_scale,
            v_scale,
            *scale_strides,
            qo,
            qo_scales,
            num_seqs,
            m_out,
            NUM_HEADS=num_heads,
            GROUP=group,
            GROUP_PAD=group_pad,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_N=tile.block_n,
            NUM_SPLITS=num_splits,
            TABLE_PAD=table_pad,
            FP8=fp8,
            DOT_DTYPE=dot_dtype,
            QUANTIZE=quantize,
            PDL=pdl(q.device),
            WARP_SPECIALIZE=bool(tile.warp_specialize),
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
            **launch_options(q.device),
        )
        return QuantizedRows(qo, qo_scales, num_seqs, q.dtype) if quantize else out

    def _pick_num_splits(
        self, num_programs: int, max_context: int, block_n: int, device: torch.device
    ) -> int:
        """Splits until about PROGRAMS_PER_SM programs per SM, each keeping at least
        MIN_TILES_PER_SPLIT key tiles of the longest context the block tables address."""
        max_tiles = math.ceil(max_context / block_n)
        target = self.PROGRAMS_PER_SM * _num_sms(device)
        splits = 1
        while (
            splits < 64
            and num_programs * splits < target
            and max_tiles >= 2 * splits * self.MIN_TILES_PER_SPLIT
        ):
            splits *= 2
        return splits
