"""The batched multi-LoRA kernels (``add_lora``) beside the base linear they add to, on a CUDA GPU.

    python benchmarks/lora_kernels.py [--models 0.6b 8b] [--rank 16] [--slots 4] [--dtype bf16]

For each projection of Qwen3-0.6B and Qwen3-8B (qkv, o, gate_up, down; the LoRA rank stacked per
fused slice: qkv 3 * rank, gate_up 2 * rank) and each token count, rows spread evenly over the
slots: GPU time of ``F.linear`` and of ``add_lora`` (one cuBLAS shrink for every slot, then one
Triton expand) with ``max_rows`` the largest count (as run eagerly) and with ``max_rows`` the token
count (as in a CUDA graph captured for that batch size), then with every count zero (256 tokens).
``tile``: the expand's block_m x block_n x block_r that ``add_lora`` chose for ``max_rows`` = T.
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
    from nanovllm.lora.triton_ops import add_lora, lora_tile

    torch.manual_seed(0)
    dtype, dev, slots = DTYPES[args.dtype], "cuda", args.slots
    bench = lambda fn: time_us(fn, args.replays, args.calls)  # noqa: E731
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    header = f"{'model':5s} {'proj':7s} {'K':>5s} {'N':>6s} {'R':>3s} {'T':>5s} | "
    print(header + "linear us | lora us: max_rows=max count, =T | tile (=T) | lora(=T)/linear")
    for model in args.models:
        for proj, (k, n, rank) in projections(model, args.rank).items():
            w = torch.randn(n, k, device=dev, dtype=dtype) * k**-0.5
            lora_a = torch.randn(slots, rank, k, device=dev, dtype=dtype) * k**-0.5
            lora_b = torch.randn(slots, n, rank, device=dev, dtype=dtype) * 0.01
            for num_tokens in [*args.tokens, 0]:
                zero = num_tokens == 0  # every count zero, at 256 tokens
                num_tokens = 256 if zero else num_tokens
                x = torch.randn(num_tokens, k, device=dev, dtype=dtype)
                y = torch.zeros(num_tokens, n, device=dev, dtype=dtype)
                counts = [0] * slots if zero else even_counts(num_tokens, slots)
                starts = [sum(counts[:s]) for s in range(slots)]
                order = as_tensor(list(range(num_tokens)))
                starts, counts, max_count = as_tensor(starts), as_tensor(counts), max(counts)
                lora = lambda rows: add_lora(y, x, lora_a, lora_b, order, starts, counts, rows)  # noqa: E731
                linear = bench(lambda: F.linear(x, w))
                by_count = "-" if zero else f"{bench(lambda: lora(max_count)):.1f}"
                by_tokens = bench(lambda: lora(num_tokens))
                tile = "x".join(map(str, lora_tile(num_tokens, rank)))
                label = "0/256" if zero else str(num_tokens)  # rows with an adapter / rows
                print(
                    f"{model:5s} {proj:7s} {k:5d} {n:6d} {rank:3d} {label:>5s} | {linear:9.1f} | "
                    f"{by_count:>17s} {by_tokens:9.1f}{'':4s} | {tile:>9s} | "
                    f"{by_tokens / linear:15.2f}"
                )


if __name__ == "__main__":
    main()
