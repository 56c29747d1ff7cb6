"""Decode latency at batch 1: milliseconds per decode step of one request, from two generate calls
that differ only in their output length (the prefill and the first token cancel out). Random
weights of a named shape, drawn on the device; CUDA graphs unless --enforce-eager.

    python benchmarks/bench_latency.py --random qwen3-0.6b
    python benchmarks/bench_latency.py --random qwen3.5-9b --repeats 5 --steps 256
    python benchmarks/bench_latency.py --random qwen3-8b --profile   # GPU time per kernel
        # category of one long call (its prefill included), the GPU idle share, and what each
        # kernel of a decode step adds to its time (bench_step.py)
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random", required=True, help="a shape bench.py knows, e.g. qwen3-0.6b")
    parser.add_argument("--backend", default="auto", help="attention backend")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=256, help="decode steps timed per call")
    parser.add_argument("--repeats", type=int, default=5, help="pairs of calls (median)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--quantization", choices=("fp8",), default=None)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--profile", action="store_true", help="profile one more long call")
    args = parser.parse_args(argv)
    for name in ("prompt_len", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.checkpoint import make_random_checkpoint

    kwargs = dict(load_format="dummy", attention_backend=args.backend)
    kwargs |= dict(
        enforce_eager=args.enforce_eager, max_model_len=args.prompt_len + args.steps + 64
    )
    if args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantization:
        kwargs["quantization"] = args.quantization
    prompt = [list(range(1000, 1000 + args.prompt_len))]
    with tempfile.TemporaryDirectory(prefix="nanovllm-latency-") as tmp:
        path = make_random_checkpoint(
            tmp, args.random, torch.bfloat16, weights=False, quantization=args.quantization
        )
        with LLM(path, **kwargs) as llm:

            def seconds(max_tokens: int) -> float:
                params = SamplingParams(
                    temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True
                )
                start = time.perf_counter()
                llm.generate(prompt, params, use_tqdm=False)
                return time.perf_counter() - start

            seconds(args.steps + 1)  # warm-up
            ms = []
            for _ in range(args.repeats):
                short, long = seconds(1), seconds(args.steps + 1)
                ms.append((long - short) / args.steps * 1e3)
            if args.profile:
                from benchmarks.bench_profile import (
                    GpuProfiler,
                    category,
                    device_events,
                    format_notes,
                    format_table,
                )
                from benchmarks.bench_step import (
                    added_by_label,
                    added_times,
                    format_positions,
                    position_medians,
                    split_steps,
                )

                with GpuProfiler() as profiler:
                    wall = seconds(args.steps + 1)
                summary = profiler.summary(wall)
                raw = profiler.raw_events()
                rows = added_times(device_events(raw, torch.cuda.current_device()))
                steps = split_steps(rows, lambda name: category(name) == "sampler")
                positions, num_steps = position_medians(steps)
    spread = f"{min(ms):.3f}-{max(ms):.3f}"
    print(
        f"{args.random} decode at batch 1: {statistics.median(ms):.3f} ms/step "
        f"(median of {args.repeats}, {spread}; prompt {args.prompt_len}, {args.steps} steps)"
    )
    if args.profile:
        print(f"GPU time by kernel category, one call of {args.steps + 1} tokens ({wall:.3f} s):")
        print(format_table(summary))
        print(format_notes(summary, profiler.window))
        print(format_positions(positions, num_steps))
        by_category = added_by_label(positions, category)
        print(
            "added per step by category: "
            + ", ".join(f"{label} {seconds * 1e6:.1f} us" for label, seconds in by_category.items())
        )


if __name__ == "__main__":
    main()
