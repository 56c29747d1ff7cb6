"""The all-reduce of tensor parallelism alone: NCCL against the one-shot kernel
(``nanovllm/parallel/custom_all_reduce.py``) over the GPUs of this host, one process each, at the
sizes of a decode step (a bf16 row of hidden size 4096 is 8 KiB; 256 rows are 2 MiB) and above.

Each size is first checked (the one-shot sum equals NCCL's, bit for bit, with two ranks), then
timed as a decode step runs it: a CUDA graph holding --calls all-reduces, replayed --iters times
after warm-up, timed with CUDA events on rank 0; the figure is the time per all-reduce.

    python benchmarks/bench_all_reduce.py                # 2 GPUs, 8 KiB .. 32 MiB of bf16
    python benchmarks/bench_all_reduce.py --world 4
    # another shape of the kernel:
    python benchmarks/bench_all_reduce.py --block 2048 --programs 128 --warps 8
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: nanovllm

from nanovllm.parallel import custom_all_reduce, distributed, group  # noqa: E402
from nanovllm.parallel.custom_all_reduce import MAX_BYTES  # noqa: E402

SIZES_KIB = [8, 32, 128, 512, 1024, 2048, 4096, 8192, 32768]


def time_graph(fn, x: torch.Tensor, calls: int, iters: int) -> float:
    """Microseconds per call of ``fn(x)`` replayed from a CUDA graph of ``calls`` calls."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    for _ in range(3):
        graph.replay()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (iters * calls)


def _worker(rank: int, world: int, port: int, args) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group.init_process_group(device, rank, world, port)
    custom_all_reduce.BLOCK, custom_all_reduce.PROGRAMS = args.block, args.programs
    custom_all_reduce.NUM_WARPS = args.warps
    assert group.enable_custom_all_reduce(device, torch.bfloat16), (
        "the GPUs do not reach each other directly"
    )
    custom = distributed._custom_all_reduce
    rows = []
    for kib in args.sizes:
        numel = kib * 1024 // 2
        torch.manual_seed(rank)
        x = torch.randn(numel, device=device, dtype=torch.bfloat16)
        nccl_us = time_graph(dist.all_reduce, x, args.calls, args.iters)
        one_shot_us = None
        if kib * 1024 <= MAX_BYTES:
            a, b = x.clone(), x.clone()
            dist.all_reduce(a)
            custom(b)
            assert world > 2 or torch.equal(a, b), f"{kib} KiB: the sums differ"
            one_shot_us = time_graph(custom, x, args.calls, args.iters)
        rows.append((kib, nccl_us, one_shot_us))
    if rank == 0:
        print(
            f"{world} GPUs ({torch.cuda.get_device_name(device)}), bf16, µs per all-reduce "
            f"(CUDA graph of {args.calls} calls, {args.iters} replays); one-shot kernel: blocks of "
            f"{args.block} elements, at most {args.programs} programs of {args.warps} warps:"
        )
        print("| size | NCCL | one-shot | NCCL / one-shot |\n|---:|---:|---:|---:|")
        for kib, nccl_us, one_us in rows:
            size = f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"
            if one_us is None:
                print(f"| {size} | {nccl_us:.1f} | (NCCL) | |")
            else:
                print(f"| {size} | {nccl_us:.1f} | {one_us:.1f} | {nccl_us / one_us:.2f}× |")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES_KIB, help="KiB of bf16 each")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--block",
        type=int,
        default=custom_all_reduce.BLOCK,
        help="elements a program sums at a time",
    )
    parser.add_argument(
        "--programs",
        type=int,
        default=custom_all_reduce.PROGRAMS,
        help="the most programs of a call",
    )
    parser.add_argument(
        "--warps", type=int, default=custom_all_reduce.NUM_WARPS, help="warps per program"
    )
    args = parser.parse_args()
    from nanovllm.runner.executor import _free_port

    mp.spawn(_worker, args=(args.world, _free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
