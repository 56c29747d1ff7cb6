"""The KV cache of one rank: its layout (one tensor whose per-layer views the attention layers get),
and how many blocks fit: on a GPU, sized from a warm-up's activation peak and the CUDA-graph pool."""

import gc
import os

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.engine.step import SamplingRows, Step
from nanovllm.layers.attention import (
    KV_SCALE_DTYPE,
    Attention,
    empty_kv_scales,
    is_fp8_kv_cache,
    kv_cache_storage_dtype,
)
from nanovllm.sampling_params import SamplingParams

# share of GPU memory kept out of the KV cache for what sizing cannot see: allocator fragmentation
# over many step shapes, and kernels loaded after start-up (measured overshoot without it: 0.5%)
GPU_HEADROOM = 0.01
CPU_KV_CACHE_SHARE = 0.25  # on CPU, num_kvcache_blocks=-1 takes this share of available memory


def block_bytes(config, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, K and V: its rows, plus one float32 scale per
    (token, KV head) row for an FP8 cache."""
    row_bytes = head_dim * kv_cache_storage_dtype(config.kv_cache_dtype, dtype).itemsize
    if is_fp8_kv_cache(config.kv_cache_dtype):
        row_bytes += KV_SCALE_DTYPE.itemsize
    return (
        2
        * config.hf_config.num_hidden_layers
        * config.kvcache_block_size
        * num_kv_heads
        * row_bytes
    )


def bind_kv_cache(
    model,
    config,
    num_blocks: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The one place that knows the cache layout: one tensor
    [2, layers, blocks, block_size, kv_heads, head_dim]; each layer gets its K and V views. An FP8
    cache holds e4m3 values, and a second tensor (``empty_kv_scales``) their float32 scales, held
    only by the layers' k_scale/v_scale views (it goes with the model). Returns the cache."""
    shape = (
        2,
        config.hf_config.num_hidden_layers,
        num_blocks,
        config.kvcache_block_size,
        num_kv_heads,
    )
    cache = torch.empty(
        *shape, head_dim, dtype=kv_cache_storage_dtype(config.kv_cache_dtype, dtype), device=device
    )
    scales = (
        empty_kv_scales(*shape, device=device) if is_fp8_kv_cache(config.kv_cache_dtype) else None
    )
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for i, module in enumerate(layers):
        module.k_cache, module.v_cache = cache[0, i], cache[1, i]
        module.k_scale = None if scales is None else scales[0, i]
        module.v_scale = None if scales is None else scales[1, i]
    return cache


def unbind_kv_cache(model) -> None:
    """Take the cache views back from the attention layers (as built: an empty cache, which
    stores nothing), so that the cache's memory is freed once its tensor is dropped."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.k_cache = module.v_cache = torch.tensor([])
            module.k_scale = module.v_scale = None


def warmup_step(config) -> Step:
    """A prefill of the largest batch, without a cache: the activation peak."""
    max_tokens = config.max_num_batched_tokens
    seq_len = min(config.max_model_len, max_tokens)
    num_seqs = max(1, min(max_tokens // seq_len, config.max_num_seqs))
    return Step(
        True, [0] * (seq_len * num_seqs), [0] * num_seqs, [seq_len] * num_seqs, [[]] * num_seqs
    )


def heaviest_sampling(num_rows: int, vocab_size: int) -> SamplingRows:
    """The sampler's heaviest path: penalties, top-p past its candidates, logprobs, suppression,
    a grammar's token mask."""
    params = SamplingParams(
        top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5, logprobs=20, min_tokens=1
    )
    bitmask = np.full((num_rows, -(-vocab_size // 32)), -1, dtype=np.int32)  # every token allowed
    return SamplingRows(
        [1.0] * num_rows,
        list(range(num_rows)),
        [params] * num_rows,
        False,
        [[0]] * num_rows,
        [([0] * 8, [])] * num_rows,
        (list(range(num_rows)), bitmask),
    )


def activation_peak(runner) -> int:
    """Run the warm-up prefill (and on rank 0 the sampler over the largest decode batch), so the
    cache is sized from the true peak. Returns the peak bytes reserved above what stays."""
    gc.collect()  # what an earlier engine left behind must not count as in use
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    runner.run(warmup_step(runner.config))
    if runner.rank == 0:
        rows = min(runner.config.max_num_seqs, 512)
        logits = torch.zeros(rows, runner.vocab_size, dtype=runner.dtype, device=runner.device)
        runner.sample(logits, heaviest_sampling(rows, runner.vocab_size)).result()
        del logits
    peak = torch.cuda.max_memory_reserved() - torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    return peak


def graph_pool_bytes(runner) -> int:
    """Bytes the CUDA-graph pool will hold: capture the largest decode graph over a one-block
    cache, then release it (all graphs share one pool, which the largest one sizes). This also
    loads the decode kernels, whose code takes device memory outside torch."""
    cache = runner.bind_kv_cache(1)
    runner.sync()
    before = torch.cuda.memory_reserved()
    graphs = runner.capture_graphs(largest_only=True)
    pool = torch.cuda.memory_reserved() - before
    del graphs, cache
    torch.cuda.empty_cache()
    return pool


def num_blocks(runner) -> int:
    """How many blocks the cache gets (all ranks agree on the minimum). On GPU with
    ``num_kvcache_blocks=-1``: (total * (gpu_memory_utilization - headroom) - in use - activation
    peak - graph pool) // block bytes, where "in use" counts every process's memory on the device."""
    config = runner.config
    count = config.num_kvcache_blocks
    one_block = block_bytes(config, runner.num_kv_heads, runner.head_dim, runner.dtype)
    if count == -1:
        if runner.device.type == "cuda":
            peak = activation_peak(runner)
            graphs = 0 if runner.enforce_eager else graph_pool_bytes(runner)
            free, total = torch.cuda.mem_get_info()
            budget = (
                int(total * (config.gpu_memory_utilization - GPU_HEADROOM))
                - (total - free)
                - peak
                - graphs
            )
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
