import gc

import torch

from nanovllm.engine.step import Step

GPU_HEADROOM = 0.01  # GPU memory share kept for what sizing cannot see (fragmentation, kernels)


def warmup_step(config) -> Step:
    max_tokens = config.max_num_batched_tokens
    seq_len = min(config.max_model_len, max_tokens)
    num_seqs = max(1, min(max_tokens // seq_len, config.max_num_seqs))
    n = num_seqs
    return Step(True, [0] * (seq_len * n), [0] * n, [seq_len] * n, [[]] * n)


def activation_peak(runner) -> int:
    """Peak bytes reserved above what stays during the warm-up."""
    gc.collect()  # what an earlier engine left behind must not count as in use
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    runner.run(warmup_step(runner.config))
    if runner.rank == 0:
        rows = min(runner.config.max_num_seqs, 512)
        logits = torch.zeros(rows, runner.vocab_size, dtype=runner.dtype, device=runner.device)
        from nanovllm.sampling.extras import heaviest_sampling

        runner.sample(logits, heaviest_sampling(rows, runner.vocab_size)).result()
        del logits
    peak = torch.cuda.max_memory_reserved() - torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    return peak


def graph_pool_bytes(runner) -> int:
    cache = runner.bind_kv_cache(1)
    runner.sync()
    before = torch.cuda.memory_reserved()
    graphs = runner.capture_graphs(largest_only=True)
    pool = torch.cuda.memory_reserved() - before
    del graphs, cache
    torch.cuda.empty_cache()
    return pool


def kv_cache_budget(runner) -> int:
    """(total * (utilization - headroom) - in use - activation peak - graph pool) bytes."""
    peak = activation_peak(runner)
    graphs = 0 if runner.enforce_eager else graph_pool_bytes(runner)
    free, total = torch.cuda.mem_get_info()
    usable = int(total * (runner.config.gpu_memory_utilization - GPU_HEADROOM))
    return usable - (total - free) - peak - graphs
