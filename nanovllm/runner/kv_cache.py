"""The KV cache of one rank: its layout, and how many blocks fit."""

import os

import torch
import torch.distributed as dist

from nanovllm.layers.attention import Attention, is_fp8_kv_cache
from nanovllm.models.config import kv_layers

CPU_KV_CACHE_SHARE = 0.25  # on CPU, num_kvcache_blocks=-1 takes this share of available memory


def block_bytes(config, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    row_bytes = head_dim * dtype.itemsize
    if is_fp8_kv_cache(config.kv_cache_dtype):
        from nanovllm.layers.attention.fp8_kv import FP8_DTYPE, KV_SCALE_DTYPE

        row_bytes = head_dim * FP8_DTYPE.itemsize + KV_SCALE_DTYPE.itemsize
    num_rows = 2 * kv_layers(config.hf_config) * config.kvcache_block_size * num_kv_heads
    return num_rows * row_bytes


def bind_kv_cache(model, config, num_blocks, num_kv_heads, head_dim, dtype, device) -> torch.Tensor:
    """The one place that knows the cache layout: [2, layers, blocks, block_size, kv_heads,
    head_dim]; each layer gets its K and V views."""
    shape = (2, kv_layers(config.hf_config), num_blocks, config.kvcache_block_size)
    shape += (num_kv_heads,)
    scales = None
    if is_fp8_kv_cache(config.kv_cache_dtype):
        from nanovllm.layers.attention.fp8_kv import FP8_DTYPE, empty_kv_scales

        dtype, scales = FP8_DTYPE, empty_kv_scales(*shape, device=device)
    cache = torch.empty(*shape, head_dim, dtype=dtype, device=device)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for i, module in enumerate(layers):
        module.k_cache, module.v_cache = cache[0, i], cache[1, i]
        module.k_scale = None if scales is None else scales[0, i]
        module.v_scale = None if scales is None else scales[1, i]
    return cache


def num_blocks(runner) -> int:
    """How many blocks fit (-1) or were asked for; all ranks take the minimum."""
    config = runner.config
    count = config.num_kvcache_blocks
    one_block = block_bytes(config, runner.num_kv_heads, runner.head_dim, runner.dtype)
    if count == -1:
        if runner.device.type == "cuda":
            from nanovllm.runner.gpu_memory import kv_cache_budget

            budget = kv_cache_budget(runner)
        else:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
            blocks_per_seq = -(-config.max_model_len // config.kvcache_block_size)
            share = CPU_KV_CACHE_SHARE / config.data_parallel_size  # the replicas share the machine
            budget = min(int(available * share), config.max_num_seqs * blocks_per_seq * one_block)
        count = budget // one_block
    if runner.world_size > 1:
        t = torch.tensor([count], device=runner.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        runner.sync()
        count = int(t.item())
    if count <= 0:
        raise RuntimeError(
            f"no KV-cache block fits in memory (one block takes {one_block / 2**20:.1f} MiB); "
            "raise gpu_memory_utilization, or lower max_num_batched_tokens / max_model_len"
        )
    return count
