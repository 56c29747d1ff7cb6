"""Offline throughput benchmark: the original nano-vllm workload.

256 requests (random.seed(0)); each prompt has randint(100, 1024) tokens drawn as randint(0, 10000);
each request's max_tokens is randint(100, 1024), drawn after all prompts; temperature 0.6,
ignore_eos. One short warm-up generate comes first. 133,966 output tokens in all.

    python bench.py                          # ~/huggingface/Qwen3-0.6B
    python bench.py --random qwen3-0.6b      # a random checkpoint of that shape (no weights needed)
    python bench.py --random qwen3-4b --tp 2 --backend triton --enforce-eager
    python bench.py --random qwen3-0.6b --top-p 0.95 --top-k 20   # Qwen3's recommended sampling
    python bench.py --sampler --top-p 0.95 --top-k 20   # the sampler alone, GPU time per step
    python bench.py --random qwen3-0.6b --profile   # GPU time per kernel category and kernel,
                                                    # and the GPU's idle share
    python bench.py --random qwen3-8b --dp 2 --num-seqs 1024   # two replicas, one GPU each
    python bench.py --random qwen3-8b --quantization fp8       # FP8 weights in Qwen's block format

--profile runs the timed generate under torch.profiler (kineto's CUDA activity only, see
benchmarks/bench_profile.py); its result line is the profiled run's, so compare it with a run
without --profile (a second timed run in the same engine would be served from the prefix cache).

The other measuring tools live in benchmarks/ (run them from the repository root, e.g.
``python benchmarks/bench_floor.py``); they import this file's ``workload``.
"""

import argparse
import contextlib
import os
import tempfile
import time
from random import randint, seed

from nanovllm import LLM, SamplingParams

DUMMY_ABOVE = 8 << 30  # bytes of weights (bf16, or FP8 with its scales)


def workload(num_seqs: int, max_input_len: int = 1024, max_output_len: int = 1024, **sampling):
    seed(0)
    prompts = [
        [randint(0, 10000) for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)
    ]
    params = [
        SamplingParams(
            temperature=0.6, ignore_eos=True, max_tokens=randint(100, max_output_len), **sampling
        )
        for _ in range(num_seqs)
    ]
    return prompts, params


def time_sampler(sampling: dict, num_seqs: int, vocab_size: int = 151936, iters: int = 100) -> None:
    """GPU time of one sampling step at this batch size (random bf16 logits; CUDA events)."""
    from random import Random

    import torch

    from nanovllm.engine.sequence import Sequence
    from nanovllm.engine.step import build_step
    from nanovllm.features.attach import attach_processors
    from nanovllm.sampling.sampler import Sampler, make_sampling_batch

    params = SamplingParams(temperature=0.6, **sampling)
    seqs = [Sequence([1] * 8, params, 256) for _ in range(num_seqs)]
    attach_processors(seqs, [])
    logits = (torch.randn(num_seqs, vocab_size, device="cuda") * 3).to(torch.bfloat16)
    batch = make_sampling_batch(
        build_step(seqs, False, Random(0)).sampling,
        vocab_size,
        lambda v, dtype: torch.tensor(v, dtype=dtype, device="cuda"),
    )
    sampler = Sampler()
    for _ in range(10):
        sampler(logits, batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        sampler(logits, batch)
    end.record()
    torch.cuda.synchronize()
    print(
        f"sampler {sampling or 'temperature only'}: batch {num_seqs} x {vocab_size}: "
        f"{start.elapsed_time(end) / iters * 1000:.0f} us per step"
    )


def gpu_memory_report() -> str:
    """Device memory in use (all processes, from the driver) and this process's peak reserve."""
    import torch

    if not torch.cuda.is_available():
        return ""
    free, total = torch.cuda.mem_get_info()
    return (
        f"GPU memory in use: {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB "
        f"({(total - free) / total:.1%}); torch peak reserved "
        f"{torch.cuda.max_memory_reserved() / 2**30:.1f} GiB"
    )


def lora_requests(model: str, n: int, rank: int, num_seqs: int):
    """``num_seqs`` requests spread round-robin over ``n`` random adapters (None when n is 0)."""
    from transformers import AutoConfig

    from nanovllm.lora.random_adapter import save_random_adapter
    from nanovllm.lora.request import LoRARequest

    tmp = tempfile.TemporaryDirectory(prefix="nanovllm-lora-")
    hf_config = AutoConfig.from_pretrained(model)
    folders = [
        save_random_adapter(f"{tmp.name}/{i}", hf_config, rank=rank, seed=i) for i in range(n)
    ]
    loras = [LoRARequest(f"adapter{i}", i + 1, folder) for i, folder in enumerate(folders)]
    return ([loras[i % n] for i in range(num_seqs)] if n else None), tmp


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=os.path.expanduser("~/huggingface/Qwen3-0.6B"))
    parser.add_argument(
        "--random",
        metavar="SHAPE",
        default=None,
        help="benchmark a randomly initialised checkpoint of this shape (qwen3-0.6b, qwen3-4b, "
        "qwen3-8b, qwen3-30b-a3b, qwen2.5-0.5b, llama3.2-1b, qwen3.5-9b, qwen3.5-35b-a3b); above "
        "8 GiB of weights, and Qwen3.5's, with load_format='dummy'",
    )
    parser.add_argument(
        "--backend", default="auto", help="attention backend: auto, flash-attn, triton, torch"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument(
        "--dp", type=int, default=1, help="data_parallel_size (replicas of --tp GPUs each)"
    )
    parser.add_argument(
        "--dp-backend", choices=("mp", "ray"), default="mp", help="data_parallel_backend"
    )
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--top-p", type=float, default=None, help="SamplingParams.top_p of every request"
    )
    parser.add_argument(
        "--top-k", type=int, default=None, help="SamplingParams.top_k of every request"
    )
    parser.add_argument(
        "--min-p", type=float, default=None, help="SamplingParams.min_p of every request"
    )
    parser.add_argument(
        "--sampler", action="store_true", help="time the sampler alone (GPU), at --num-seqs rows"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="LLM(kv_cache_dtype=...); 'auto' passes nothing (the engine's default)",
    )
    parser.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="with --random: the checkpoint in Qwen's FP8 format (128x128 blocks, W8A8)",
    )
    parser.add_argument(
        "--no-async-scheduling", action="store_true", help="LLM(async_scheduling=False)"
    )
    parser.add_argument(
        "--nccl-all-reduce",
        action="store_true",
        help="LLM(disable_custom_all_reduce=True): NCCL for every all-reduce of --tp",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=None,
        metavar="N",
        help="LLM(enable_lora=True, max_loras=max(N, 1)); requests spread over N random adapters "
        "(0: none) of --lora-rank on all seven projections",
    )
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print GPU time per kernel category and per kernel and the GPU idle share of the "
        "timed run",
    )
    parser.add_argument(
        "--profile-trace",
        metavar="PATH",
        default=None,
        help="with --profile (implied): also save the profiler's Chrome trace (JSON) here",
    )
    args = parser.parse_args()
    sampling = {
        k: v
        for k, v in (("top_p", args.top_p), ("top_k", args.top_k), ("min_p", args.min_p))
        if v is not None
    }
    if args.sampler:
        return time_sampler(sampling, args.num_seqs)

    tmp = None
    path = args.model
    if args.random:
        import torch

        from nanovllm.utils.checkpoint import make_random_checkpoint, model_config, weight_bytes
        from nanovllm.utils.hybrid_shapes import HYBRID_SHAPES

        tmp = tempfile.TemporaryDirectory(prefix="nanovllm-bench-")
        # shapes over DUMMY_ABOVE bytes are not written: their weights are drawn on the device
        dummy = args.random in HYBRID_SHAPES or (  # hybrid shapes: never written
            weight_bytes(model_config(args.random), quantization=args.quantization) > DUMMY_ABOVE
        )
        path = make_random_checkpoint(
            tmp.name,
            args.random,
            dtype=torch.bfloat16,
            weights=not dummy,
            quantization=args.quantization,
        )
    elif args.quantization:
        parser.error(
            "--quantization goes with --random "
            "(a checkpoint's own format is read from its config.json)"
        )
    elif not os.path.isdir(path):
        parser.error(f"no model at {path}; pass --model PATH or --random qwen3-0.6b")

    llm_kwargs = dict(
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tp,
        attention_backend=args.backend,
    )
    if (
        args.dp > 1 or args.dp_backend != "mp"
    ):  # only then, so this script also runs on engines without them
        llm_kwargs |= dict(data_parallel_size=args.dp, data_parallel_backend=args.dp_backend)
    if args.random and dummy:
        llm_kwargs["load_format"] = "dummy"
    if args.nccl_all_reduce:  # only then, so this script also runs on engines without the keyword
        llm_kwargs["disable_custom_all_reduce"] = True
    if (
        args.kv_cache_dtype != "auto"
    ):  # only then, so this script also runs on engines without the keyword
        llm_kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.no_async_scheduling:
        llm_kwargs["async_scheduling"] = False
    if args.quantization:  # only then, so this script also runs on engines without the keyword
        llm_kwargs["quantization"] = args.quantization
    profiling = args.profile or args.profile_trace is not None
    profiler = contextlib.nullcontext()
    if profiling:
        from benchmarks.bench_profile import GpuProfiler

        profiler = GpuProfiler(args.profile_trace)

    prompts, params = workload(args.num_seqs, **sampling)
    loras = None
    if args.lora is not None:  # only then, so this script also runs on engines without LoRA
        loras, lora_tmp = lora_requests(path, args.lora, args.lora_rank, args.num_seqs)
        llm_kwargs |= dict(enable_lora=True, max_loras=max(args.lora, 1))
        llm_kwargs["max_lora_rank"] = args.lora_rank
    with LLM(path, **llm_kwargs) as llm:
        # the warm-up also loads the adapters (one request each): the timed run serves them
        warm = {"lora_request": list(dict.fromkeys(loras))} if loras else {}
        llm.generate(
            ["Benchmark: "] * len(warm.get("lora_request", [0])),
            SamplingParams(),
            use_tqdm=False,
            **warm,
        )
        with profiler:
            t = time.perf_counter()
            llm.generate(
                prompts, params, use_tqdm=False, **({"lora_request": loras} if loras else {})
            )
            t = time.perf_counter() - t
        # with data parallelism the runners live in the replicas: the configured name stands
        # for them
        backend = (
            llm.core.executor.runner.backend.name if hasattr(llm.core, "executor") else args.backend
        )
        config = llm.config
        memory = gpu_memory_report()
    total = sum(p.max_tokens for p in params)
    custom = (
        ""
        if args.tp == 1
        else f" custom_all_reduce={not getattr(config, 'disable_custom_all_reduce', True)}"
    )
    print(
        f"backend={backend} eager={config.enforce_eager} tp={config.tensor_parallel_size}{custom} "
        f"dp={getattr(config, 'data_parallel_size', 1)}"
        f"{'/ray' if args.dp_backend == 'ray' else ''} "
        f"kv_cache_dtype={getattr(config, 'kv_cache_dtype', 'auto')} "
        f"weights={getattr(config, 'weight_quantization', None) or 'model dtype'} "
        f"async_scheduling={getattr(config, 'async_scheduling', None)} "
        f"max_model_len={config.max_model_len} "
        f"block_size={config.kvcache_block_size} max_num_seqs={config.max_num_seqs} "
        f"max_num_batched_tokens={config.max_num_batched_tokens} requests={args.num_seqs} "
        f"sampling={sampling or 'temperature 0.6'} "
        f"model={'random:' + args.random if args.random else path} "
        f"profiled={profiling}"
        + (f" lora={args.lora}x r{args.lora_rank}" if args.lora is not None else "")
    )
    print(f"Total: {total}tok, Time: {t:.2f}s, Throughput: {total / t:.2f}tok/s")
    if memory:
        print(memory)
    if profiling:
        from benchmarks.bench_profile import format_notes, format_table

        summary = profiler.summary(t)
        note = " (rank 0's GPU)" if args.tp > 1 else ""
        print(f"GPU time by kernel category{note}, timed run under the profiler:")
        print(format_table(summary))
        print(format_notes(summary, profiler.window))
        if args.profile_trace:
            print(f"Chrome trace: {args.profile_trace}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
