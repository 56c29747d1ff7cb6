"""The batched multi-LoRA layer (``lora_linear``) beside its base linear, on a CUDA GPU.

    python benchmarks/lora_kernels.py [--models 0.6b 8b] [--rank 16] [--slots 4] [--dtype bf16]

For each projection of Qwen3-0.6B and Qwen3-8B (qkv, o, gate_up, down; the LoRA rank stacked per
fused slice: qkv 3 * rank, gate_up 2 * rank) and each token count, rows spread evenly over the
slots: GPU time of ``F.linear`` over the weight and of ``lora_linear`` (one cuBLAS GEMM over the
weight and every slot's A, then one Triton kernel), with every row on an adapter and with none.
``tile``: the kernel's block_m x block_n x block_r for T rows.
Times are medians over CUDA-graph replays (each replays the call ``--calls`` times), timed with
CUDA events: host launch overhead is not counted.
"""

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

MODELS = {  # hidden, q, kv (each of k and v), intermediate
    "0.6b": (1024, 2048, 1024, 3072),
    "8b": (4096, 4096, 1024, 12288),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def projections(model: str, rank: int) -> dict[str, tuple[int, int, int]]:
    """name: (K, N, stacked rank R)."""
    hidden, q, kv, inter = MODELS[model]
    return {
        "qkv": (hidden, q + 2 * kv, 3 * rank),
        "o": (q, hidden, rank),
        "gate_up": (hidden, 2 * inter, 2 * rank),
        "down": (inter, hidden, rank),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["0.6b", "8b"])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank per slice")
    parser.add_argument("--slots", type=int, default=4, help="adapter slots, all used")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 512, 8192])
    parser.add_argument("--replays", type=int, default=30, help="timed graph replays (median)")
    parser.add_argument("--calls", type=int, default=10, help="calls captured per graph")
    args = parser.parse_args(argv)
    for name in ("rank", "slots", "replays", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.tokens) < 1:
        parser.error(f"--tokens must all be >= 1, got {args.tokens}")
    return args


def time_us(fn, replays: int, calls: int) -> float:
    """Median microseconds per call of ``fn`` over CUDA-graph replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def even_counts(num_tokens: int, num_slots: int) -> list[int]:
    """Rows per slot, as even as they come (the first slots take the remainder)."""
    return [num_tokens // num_slots + (s < num_tokens % num_slots) for s in range(num_slots)]


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("lora_kernels.py times GPU kernels: it needs a CUDA GPU (none is visible)")
    import numpy as np

    from nanovllm.lora.blocks import block_table
    from nanovllm.lora.triton_ops import launch_lora, lora_tile

    torch.manual_seed(0)
    dtype, dev, slots = DTYPES[args.dtype], "cuda", args.slots
    bench = lambda fn: time_us(fn, args.replays, args.calls)  # noqa: E731
    header = f"{'model':5s} {'proj':7s} {'K':>5s} {'N':>6s} {'W':>3s} {'T':>5s} | "
    print(header + "linear us | lora us: all rows, none | tile | lora(all)/linear")
    for model in args.models:
        for proj, (k, n, width) in projections(model, args.rank).items():
            ext = torch.randn(n + slots * width, k, device=dev, dtype=dtype) * k**-0.5
            w, lora_b = ext[:n], torch.randn(slots, n, width, device=dev, dtype=dtype) * 0.01
            for num_tokens in args.tokens:
                x = torch.randn(num_tokens, k, device=dev, dtype=dtype)
                counts = even_counts(num_tokens, slots)
                spread = np.repeat(np.arange(slots), counts)
                times = []
                for rows in (spread, np.full(num_tokens, -1)):
                    blocks, order = (
                        torch.from_numpy(t).to(dev) for t in block_table(rows, num_tokens, slots)
                    )
                    times.append(bench(lambda: launch_lora(x, ext, lora_b, None, blocks, order)))
                linear = bench(lambda: F.linear(x, w))
                tile = "x".join(map(str, lora_tile(num_tokens, width)))
                print(
                    f"{model:5s} {proj:7s} {k:5d} {n:6d} {width:3d} {num_tokens:5d} | "
                    f"{linear:9.1f} | {times[0]:16.1f} {times[1]:5.1f} | {tile:>9s} | "
                    f"{times[0] / linear:16.2f}"
                )


if __name__ == "__main__":
    main()
