"""A MoE layer's routing and grouping alone: the torch path (``select_experts`` +
``group_by_expert``, some thirty small kernels) against the Triton kernels
(``select_experts_triton`` + ``group_by_expert_triton``, three launches), on Qwen3-30B-A3B's router
(128 experts, top-8, renormalised) from decode batches to long prefills. GPU only.

Router logits are N(0, 1) in bf16 (seed 0); each size takes the block_m that ``moe_tile`` picks for
it. Both paths are first checked to give the same ids and layout, then timed with CUDA events as
the median of --iters calls after warm-up: replays of a CUDA graph that holds one call (as a decode
step runs), and with ``--eager`` plain calls too (as a prefill runs). Times are per layer; a
Qwen3-30B-A3B step runs 48 of them.

    python benchmarks/bench_moe_routing.py       # 1..512 decode tokens, 1k..16k prefill tokens
    python benchmarks/bench_moe_routing.py --eager --tokens 1 64 4096 16384
    python benchmarks/bench_moe_routing.py --experts 60 --top-k 4

Results: ``bench_moe_routing.md`` beside this file.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: nanovllm

from nanovllm.layers.moe.fused import group_by_expert, moe_tile  # noqa: E402
from nanovllm.layers.moe.layer import select_experts  # noqa: E402
from nanovllm.layers.moe.routing import group_by_expert_triton, select_experts_triton  # noqa: E402

DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def torch_path(logits, top_k, num_experts, block_m):
    _, ids = select_experts(logits, top_k, True)
    return group_by_expert(ids, num_experts, block_m)


def triton_path(logits, top_k, num_experts, block_m):
    _, ids = select_experts_triton(logits, top_k, True)
    return group_by_expert_triton(ids, num_experts, block_m)


def median_us(fn, iters: int, graph: bool) -> float:
    """Median time of one call in microseconds: graph replays, or plain calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            fn()
        fn = cuda_graph.replay
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument(
        "--eager", action="store_true", help="also time plain calls, outside a CUDA graph"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_routing.py needs a CUDA GPU")
    print(
        f"# {torch.cuda.get_device_name()}, {args.experts} experts, top-{args.top_k}, bf16 logits; "
        f"microseconds per layer, median of {args.iters}"
    )
    modes = ["graph", "eager"] if args.eager else ["graph"]
    print("tokens  block_m  " + "  ".join(f"torch_{m:<5}  triton_{m:<5}  speedup" for m in modes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for num_tokens in args.tokens:
        logits = torch.randn(num_tokens, args.experts, device="cuda", generator=gen).bfloat16()
        block_m = moe_tile(num_tokens, args.top_k, args.experts, 2).block_m
        call_args = (logits, args.top_k, args.experts, block_m)
        ref, out = torch_path(*call_args), triton_path(*call_args)
        if not all(torch.equal(a, b) for a, b in zip(ref, out)):
            raise SystemExit(f"the two paths disagree at {num_tokens} tokens")
        row = f"{num_tokens:>6}  {block_m:>7}"
        for mode in modes:
            t_torch = median_us(lambda: torch_path(*call_args), args.iters, mode == "graph")
            t_triton = median_us(lambda: triton_path(*call_args), args.iters, mode == "graph")
            row += f"  {t_torch:>11.1f}  {t_triton:>12.1f}  {t_torch / t_triton:>7.2f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
