"""The KV cache of one rank: how many blocks fit (sized from a warm-up's activation peak and the
CUDA-graph pool on a GPU), and its one tensor, whose per-layer views the attention layers get."""
import gc
import os

import torch
import torch.distributed as dist

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import (
    KV_SCALE_DTYPE, Attention, empty_kv_scales, is_fp8_kv_cache, kv_cache_storage_dtype,
)
from nanovllm.sampling_params import SamplingParams

# share of GPU memory kept out of the KV cache for what sizing cannot see: allocator fragmentation
# over many step shapes, and kernels loaded after start-up (measured overshoot without it: 0.5%)
GPU_HEADROOM = 0.01
CPU_KV_CACHE_SHARE = 0.25  # on CPU, num_kvcache_blocks=-1 takes this share of available memory


class KVCacheAllocator:
    """Mixed into ``ModelRunner``: uses its config, model, device, dtype, ``run``, ``sample``,
    ``sync`` and CUDA-graph capture."""

    def warmup_model(self) -> int:
        """One prefill of the largest batch (and one sampling of the largest decode batch), so the
        KV cache is sized from the true peak. Returns the peak bytes reserved above what stays."""
        gc.collect()  # what an earlier engine left behind must not count as in use
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        max_tokens = self.config.max_num_batched_tokens
        seq_len = min(self.config.max_model_len, max_tokens)
        num_seqs = max(1, min(max_tokens // seq_len, self.config.max_num_seqs))
        seqs = []
        for _ in range(num_seqs):
            seq = Sequence([0] * seq_len, SamplingParams(), self.block_size)
            seq.num_scheduled_tokens = len(seq)
            seqs.append(seq)
        self.run(seqs, True)
        if self.rank == 0:  # the sampler's heaviest path: penalties, top-p past its candidates, logprobs
            params = SamplingParams(top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5, logprobs=20, min_tokens=1)
            seqs = [Sequence([0] * 8, params, self.block_size) for _ in range(min(self.config.max_num_seqs, 512))]
            logits = torch.zeros(len(seqs), self.vocab_size, dtype=self.dtype, device=self.device)
            self.sample(seqs, logits).result()
            del logits
        peak = torch.cuda.max_memory_reserved() - torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        return peak

    def measure_graph_memory(self) -> int:
        """Bytes the CUDA-graph pool will hold: capture the largest decode graph over a one-block
        cache, then release it. (All graphs share one pool, which the largest one sizes.) This also
        loads the decode kernels, whose code takes device memory outside torch."""
        self.bind_kv_cache(1)
        self.sync()
        before = torch.cuda.memory_reserved()
        self.capture_cudagraph(largest_only=True)
        graph_bytes = torch.cuda.memory_reserved() - before
        self._drop_graphs()
        del self.kv_cache
        torch.cuda.empty_cache()
        return graph_bytes

    def allocate_kv_cache(self) -> int:
        """Size the cache (all ranks agree on the minimum) and allocate it.

        On GPU with ``num_kvcache_blocks=-1``: blocks = (total * (gpu_memory_utilization - headroom)
        - in use - activation peak - graph pool) // block_bytes, where "in use" counts every
        process's memory on the device."""
        num_blocks = self.config.num_kvcache_blocks
        block_bytes = self.kv_cache_block_bytes()
        if num_blocks == -1:
            if self.device.type == "cuda":
                peak = self.warmup_model()
                graph_bytes = 0 if self.enforce_eager else self.measure_graph_memory()
                free, total = torch.cuda.mem_get_info()
                budget = int(total * (self.config.gpu_memory_utilization - GPU_HEADROOM))
                budget -= (total - free) + peak + graph_bytes
            else:
                available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
                blocks_per_seq = -(-self.config.max_model_len // self.block_size)
                budget = min(int(available * CPU_KV_CACHE_SHARE), self.config.max_num_seqs * blocks_per_seq * block_bytes)
            num_blocks = budget // block_bytes
        if self.world_size > 1:
            t = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            self.sync()
            num_blocks = int(t.item())
        if num_blocks <= 0:
            raise RuntimeError(
                f"no KV-cache block fits in memory (one block takes {block_bytes / 2**20:.1f} MiB); "
                "raise gpu_memory_utilization, or lower max_num_batched_tokens / max_model_len"
            )
        self.bind_kv_cache(num_blocks)
        return num_blocks

    def kv_cache_block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V: its rows, plus one float32 scale per
        (token, KV head) row for an FP8 cache."""
        layers = self.config.hf_config.num_hidden_layers
        row_bytes = self.head_dim * kv_cache_storage_dtype(self.config.kv_cache_dtype, self.dtype).itemsize
        if is_fp8_kv_cache(self.config.kv_cache_dtype):
            row_bytes += KV_SCALE_DTYPE.itemsize
        return 2 * layers * self.block_size * self.num_kv_heads * row_bytes

    def bind_kv_cache(self, num_blocks: int) -> None:
        """The one place that knows the cache layout: one tensor
        [2, layers, blocks, block_size, kv_heads, head_dim]; each layer gets its K and V views.
        An FP8 cache holds e4m3 values, and a second tensor (``empty_kv_scales``, [2, layers, blocks,
        block_size, kv_heads]) their float32 scales; only the layers' k_scale/v_scale views hold it
        (it goes with the model)."""
        shape = (2, self.config.hf_config.num_hidden_layers, num_blocks, self.block_size, self.num_kv_heads)
        cache_dtype = kv_cache_storage_dtype(self.config.kv_cache_dtype, self.dtype)
        self.kv_cache = torch.empty(*shape, self.head_dim, dtype=cache_dtype, device=self.device)
        scales = None
        if is_fp8_kv_cache(self.config.kv_cache_dtype):
            scales = empty_kv_scales(*shape, device=self.device)
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for i, module in enumerate(layers):
            module.k_cache = self.kv_cache[0, i]
            module.v_cache = self.kv_cache[1, i]
            module.k_scale = None if scales is None else scales[0, i]
            module.v_scale = None if scales is None else scales[1, i]
