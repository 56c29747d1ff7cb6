"""The few-rows linear kernel (``layers/rows_gemm.py``) beside cuBLAS (``F.linear``) at the decode
shapes of Qwen3-0.6B and Qwen3-8B, on one CUDA GPU.

    python benchmarks/bench_rows_gemm.py            # chosen tiles, 1-16 rows
    python benchmarks/bench_rows_gemm.py --sweep    # every tile / split / stage count at 1 row

As in a decode step the weights come from HBM, not L2: each timed call reads the next of enough
copies of the weight to pass 256 MB, all inside one CUDA graph (no launch overhead), and the time
is the graph's replay divided by its calls (median of 5 replays). Each variant is first checked
against ``F.linear`` (within bf16 rounding). GB/s count the weight's bytes.
"""

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from nanovllm.layers.rows_gemm import rows_linear

SHAPES = {  # name: (N, K)
    "0.6b qkv": (4096, 1024),
    "0.6b o": (1024, 2048),
    "0.6b gate_up": (6144, 1024),
    "0.6b down": (1024, 3072),
    "0.6b lm_head": (151936, 1024),
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b gate_up": (24576, 4096),
    "8b down": (4096, 12288),
    "8b lm_head": (151936, 4096),
}


def graph_time(call, copies: int) -> float:
    """Seconds per call: ``call(i)`` for each copy i, captured in one graph, median of 5."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up and compile
            call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    reps = max(1, 64 // copies)
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for i in range(copies):
                call(i)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / (reps * copies))
    return statistics.median(times)


def weights(n: int, k: int, gated: bool = False) -> list[torch.Tensor]:
    nbytes = n * k * 2
    copies = max(2, -(-256 * 2**20 // nbytes))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got.float() - want.float()).abs().max().item()
    if err > 2**-7 * want.float().abs().max().item() + 1e-3:
        raise SystemExit(f"{what}: differs from F.linear by {err}")


def sweep(name: str, k: int, time_tile, top: int = 4) -> None:
    """Prints the ``top`` fastest (block_n, splits, stages) of ``time_tile`` (seconds per call)."""
    results = []
    for block_n, splits, stages in itertools.product((32, 64, 128), (1, 2, 4, 8, 16), (3, 4, 6)):
        if -(-k // 128) < splits:
            continue
        try:
            results.append((time_tile(block_n, splits, stages), block_n, splits, stages))
        except Exception as e:  # out of shared memory, say
            print(f"  {name} {block_n}/{splits}/{stages}: {type(e).__name__}")
    results.sort()
    best = ", ".join(f"{b}/{s}/{st}: {t * 1e6:.1f}" for t, b, s, st in results[:top])
    print(f"  sweep {name} (block_n/splits/stages: us): {best}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--top", type=int, default=4, help="how many of the sweep to print")
    parser.add_argument("--rows", default="1,2,4,8,16")
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| shape | rows | cuBLAS us | ours us | cuBLAS GB/s | ours GB/s | ours / cuBLAS |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        ws = weights(n, k)
        gb = n * k * 2 / 1e9
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            check(rows_linear(x, ws[0]), F.linear(x, ws[0]), f"{name} rows {m}")
            t_cublas = graph_time(lambda i: F.linear(x, ws[i]), len(ws))
            t_ours = graph_time(lambda i: rows_linear(x, ws[i]), len(ws))
            print(
                f"| {name} | {m} | {t_cublas * 1e6:.1f} | {t_ours * 1e6:.1f} | "
                f"{gb / t_cublas:.0f} | {gb / t_ours:.0f} | {t_ours / t_cublas:.2f} |",
                flush=True,
            )
        if args.sweep:
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

            def time_tile(block_n, splits, stages):
                kw = dict(block_n=block_n, splits=splits, num_stages=stages)
                check(rows_linear(x, ws[0], **kw), F.linear(x, ws[0]), f"{name} {kw}")
                return graph_time(lambda i: rows_linear(x, ws[i], **kw), len(ws))

            sweep(name, k, time_tile, args.top)
        ws.clear()  # free the copies before the next shape


if __name__ == "__main__":
    main()
