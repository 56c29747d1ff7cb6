"""Decode attention alone, on one decode step's shape: time per call and the KV bandwidth.

The cache is paged (block size 256, block ids shuffled) and filled with N(0, 1) rows; each of the
``--num-seqs`` sequences has a context length drawn uniformly from [--min-len, --max-len] (seed 0);
the defaults resemble a mid-run step of ``bench.py``'s workload. Every candidate is first checked
against the torch backend in float32 over the same cache (dequantized for FP8), then captured in a
CUDA graph and timed with CUDA events (median of --iters replays after warm-up). "GB/s" counts the
K/V bytes the step must read (and the scales of an FP8 cache) over the median time. GPU only.

    python benchmarks/bench_attention.py              # flash-attn, Triton bf16 and FP8, defaults
    python benchmarks/bench_attention.py --sweep      # also every Triton tile of SWEEP
    python benchmarks/bench_attention.py --heads 32 --kv-heads 4
    python benchmarks/bench_attention.py --cache fp8 --tile 256,2,4 --tile 128,3,4   # given tiles
    python benchmarks/bench_attention.py --run --cache bf16   # every 16th step of bench.py's run

``--run`` replays the decode steps of ``bench.py``'s workload (its seed, prompt and output lengths;
sequence i has context prompt_len + j at its j-th decode step and leaves after its last) and sums
the median time of every ``--stride``-th step times the stride and ``--layers`` (default 28, the
Qwen3-0.6B's; 36 for the Qwen3-8B shape): the decode attention of the whole run, for each
candidate; "as is" keeps the workload's order of sequences, "sorted" orders each step longest
context first (as the scheduler does).

Run it from the repository root as ``python benchmarks/bench_attention.py ...``. It imports
``bench`` (``bench.py``'s workload) through the repository root, which the first lines below put on
``sys.path``; tools of this folder import each other by their plain names (a script's own folder is
on ``sys.path``).
"""

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.py

from bench import workload  # noqa: E402
from nanovllm.layers.attention import get_attention_backend  # noqa: E402
from nanovllm.layers.attention.fp8_kv import FP8_DTYPE, KV_SCALE_DTYPE, empty_kv_scales  # noqa: E402
from nanovllm.layers.attention.reference import TorchAttentionBackend  # noqa: E402
from nanovllm.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from nanovllm.layers.attention.triton_tiles import DecodeTile  # noqa: E402
from nanovllm.utils.context import Context  # noqa: E402

SWEEP = dict(block_n=(32, 64, 128), num_stages=(2, 3, 4), num_warps=(4, 8))


def decode_step(args, dtype: torch.dtype, fp8: bool):
    """q, the caches (and FP8 scales), the decode context and the bytes one call must read."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.num_seqs,), generator=gen)
    blocks_per_seq = -(-lens // args.block_size)
    num_blocks = int(blocks_per_seq.sum())
    width = int(blocks_per_seq.max())
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(args.num_seqs, width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq.tolist()):
        tables[i, :n] = ids[start : start + n]
        start += n
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k = torch.randn(shape, generator=gen).to("cuda", dtype)
    v = torch.randn(shape, generator=gen).to("cuda", dtype)
    q = torch.randn(args.num_seqs, args.heads, args.head_dim, generator=gen).to("cuda", dtype)
    context = Context(context_lens=lens.to("cuda", torch.int32), block_tables=tables.cuda())
    rows = int(lens.sum()) * args.kv_heads
    if not fp8:
        return q, (k, v, None, None), context, rows * args.head_dim * 2 * dtype.itemsize
    k8, v8 = (
        torch.empty(shape, dtype=FP8_DTYPE, device="cuda"),
        torch.empty(shape, dtype=FP8_DTYPE, device="cuda"),
    )
    ks, vs = (fp8_scales(shape[:3], args.token_major_scales) for _ in range(2))
    slots = torch.arange(num_blocks * args.block_size, dtype=torch.int32, device="cuda")
    TorchAttentionBackend().store_kvcache(k.flatten(0, 1), v.flatten(0, 1), k8, v8, slots, ks, vs)
    return q, (k8, v8, ks, vs), context, rows * (args.head_dim * 2 + 2 * ks.element_size())


def fp8_scales(shape: tuple, token_major: bool) -> torch.Tensor:
    """Scales [num_blocks, block_size, num_kv_heads] as the engine stores them, or contiguous."""
    if token_major:
        return torch.empty(shape, dtype=KV_SCALE_DTYPE, device="cuda")
    return empty_kv_scales(*shape, device="cuda")


def median_ms(fn, iters: int) -> float:
    """Median GPU time of ``fn`` replayed as a CUDA graph (as the engine runs decode), so that
    the host's launch overhead does not count."""
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def make_backend(name: str, tile: DecodeTile | None, rule: tuple[int, int] | None):
    """A backend by name, or a Triton one with the given decode tile and split-K rule."""
    if tile is None and rule is None:
        return get_attention_backend(name)
    backend = TritonAttentionBackend(decode_tile=tile)
    if rule:
        backend.PROGRAMS_PER_SM, backend.MIN_TILES_PER_SPLIT = rule
    return backend


GRAPH_BATCHES = (1, 2, 4, 8) + tuple(
    range(16, 257, 16)
)  # the engine's decode graphs for 256 sequences
RUN_BUCKETS = ((192, 257), (128, 192), (64, 128), (32, 64), (0, 32))  # --run's batch sizes [lo, hi)


def run_steps(stride: int) -> list[list[int]]:
    """The context lengths of every ``stride``-th decode step of bench.py's 256-request workload."""
    prompts, params = workload(256)
    lens = [(len(p), sp.max_tokens) for p, sp in zip(prompts, params)]
    return [
        [n + j for n, out in lens if j < out] for j in range(1, max(out for _, out in lens), stride)
    ]


def time_run(args, candidates: list, dtype: torch.dtype) -> None:
    """Decode attention over the whole run: per candidate and order, the sum of every stride-th
    step's median time times the stride and ``args.layers``, by batch size."""
    steps = run_steps(args.stride)
    backends = {}
    for name, fp8, tile, rule in candidates:
        try:
            backends[name, tile, rule] = make_backend(name, tile, rule)
        except Exception as e:  # flash-attn missing
            print(f"{name}: {type(e).__name__}: {str(e)[:80]}")
    candidates = [c for c in candidates if (c[0], c[2], c[3]) in backends]
    blocks = max(sum(-(-n // args.block_size) for n in lens) for lens in steps)
    gen = torch.Generator("cuda").manual_seed(0)
    shape = (blocks, args.block_size, args.kv_heads, args.head_dim)
    k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    caches = {False: (k, v, None, None)}
    if any(c[1] for c in candidates):
        k8, v8 = (torch.empty(shape, dtype=FP8_DTYPE, device="cuda") for _ in range(2))
        ks, vs = (fp8_scales(shape[:3], args.token_major_scales) for _ in range(2))
        slots = torch.arange(blocks * args.block_size, dtype=torch.int32, device="cuda")
        TorchAttentionBackend().store_kvcache(
            k.flatten(0, 1), v.flatten(0, 1), k8, v8, slots, ks, vs
        )
        caches[True] = (k8, v8, ks, vs)
    read = median_ms(lambda: torch.sum(k, dtype=torch.float32), args.iters)
    print(
        f"reference: torch.sum over the bf16 K cache ({k.nbytes / 1e9:.2f} GB) reads at "
        f"{k.nbytes / read / 1e9:.2f} TB/s"
    )
    width = -(-4096 // args.block_size)  # the graphs' block tables span max_model_len
    totals = {}  # (name, fp8, tile, rule, order) -> {bucket: [seconds, bytes]}
    for lens in steps:
        bucket = next(b for b in RUN_BUCKETS if b[0] <= len(lens) < b[1])
        for order in ("as is", "sorted"):
            context = run_context(
                sorted(lens, reverse=True) if order == "sorted" else lens,
                blocks,
                width,
                args.block_size,
            )
            q = torch.randn(
                context.block_tables.shape[0],
                args.heads,
                args.head_dim,
                generator=gen,
                device="cuda",
                dtype=dtype,
            )
            for name, fp8, tile, rule in candidates:
                kc, vc, ks, vs = caches[fp8]
                backend = backends[name, tile, rule]
                ms = median_ms(lambda: backend.decode(q, kc, vc, context, 1.0, ks, vs), args.iters)
                row_bytes = args.head_dim * 2 * kc.element_size() + (
                    2 * ks.element_size() if fp8 else 0
                )
                acc = totals.setdefault((name, fp8, tile, rule, order), {}).setdefault(
                    bucket, [0.0, 0]
                )
                acc[0] += ms * 1e-3 * args.stride * args.layers
                acc[1] += sum(lens) * args.kv_heads * row_bytes * args.stride * args.layers
    print(
        f"{len(steps)} steps (every {args.stride}th), x{args.stride} x {args.layers} layers; "
        "seconds (TB/s) by batch size"
    )
    print(
        f"{'candidate':<44} {'order':<7} {'total':>14} "
        + " ".join(f"{f'{lo}-{hi - 1}':>14}" for lo, hi in RUN_BUCKETS)
    )

    def fmt(s, n):
        return f"{s:6.3f} ({n / s / 1e12 if s else 0:4.2f})"

    for (name, fp8, tile, rule, order), by in totals.items():
        label = f"{name} {'fp8' if fp8 else 'bf16'} {tuple(tile) if tile else 'default'}" + (
            f" split {rule}" if rule else ""
        )
        cells = [by.get(b, [0.0, 0]) for b in RUN_BUCKETS]
        secs, nbytes = sum(c[0] for c in cells), sum(c[1] for c in cells)
        print(
            f"{label:<44} {order:<7} {fmt(secs, nbytes):>14} "
            + " ".join(f"{fmt(*c):>14}" for c in cells),
            flush=True,
        )


def run_context(lens: list[int], blocks: int, width: int, block_size: int) -> Context:
    """A decode step's context as the engine's graphs see it: padded to a graph batch size (rows of
    context 0), block tables ``width`` wide, each sequence's blocks drawn at random from
    ``blocks``."""
    batch = next(b for b in GRAPH_BATCHES if b >= len(lens))
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(len(lens)))
    tables = torch.zeros(batch, width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(-(-n // block_size) for n in lens):
        tables[i, :n] = ids[start : start + n]
        start += n
    context_lens = torch.tensor(lens + [0] * (batch - len(lens)), dtype=torch.int32)
    return Context(context_lens=context_lens.cuda(), block_tables=tables.cuda())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1600)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sweep", action="store_true", help="also time every Triton tile of SWEEP")
    parser.add_argument(
        "--cache", choices=("bf16", "fp8", "both"), default="both", help="which caches to time"
    )
    parser.add_argument(
        "--tile",
        action="append",
        default=[],
        metavar="BLOCK_N,STAGES,WARPS[,WS]",
        help="also time this Triton tile (repeatable; WS 1: warp-specialized key loop)",
    )
    parser.add_argument(
        "--split-rule",
        action="append",
        default=[],
        metavar="PROGRAMS_PER_SM,MIN_TILES",
        help="also time the default tile with this split-K rule (repeatable)",
    )
    parser.add_argument(
        "--token-major-scales",
        action="store_true",
        help="FP8: store the scales token-major (contiguous [blocks, block_size, kv_heads])",
    )
    parser.add_argument(
        "--run", action="store_true", help="time the decode steps of bench.py's whole run"
    )
    parser.add_argument(
        "--stride", type=int, default=16, help="with --run: time every stride-th step"
    )
    parser.add_argument(
        "--layers", type=int, default=28, help="with --run: layers a step's time is multiplied by"
    )
    args = parser.parse_args()
    dtype, scale = torch.bfloat16, args.head_dim**-0.5

    caches = {"bf16": (False,), "fp8": (True,), "both": (False, True)}[args.cache]
    candidates = [("flash-attn", False, None, None)] if False in caches else []
    candidates += [("triton", fp8, None, None) for fp8 in caches]
    if args.sweep:
        tiles = [DecodeTile(*t) for t in itertools.product(*SWEEP.values())]
        candidates += [("triton", fp8, tile, None) for fp8 in caches for tile in tiles]
    given = [DecodeTile(*map(int, t.split(","))) for t in args.tile]
    candidates += [("triton", fp8, tile, None) for fp8 in caches for tile in given]
    rules = [tuple(map(int, r.split(","))) for r in args.split_rule]
    candidates += [("triton", fp8, None, rule) for fp8 in caches for rule in rules]
    if args.run:
        return time_run(args, candidates, dtype)
    print(
        f"{args.num_seqs} seqs, contexts {args.min_len}-{args.max_len}, "
        f"{args.heads} heads / {args.kv_heads} KV heads,"
        f" head_dim {args.head_dim}, block size {args.block_size}, {torch.cuda.get_device_name()}"
    )
    print(
        f"{'backend':<10} {'cache':<5} {'tile (block_n, stages, warps)':<36} "
        f"{'us':>8} {'GB/s':>7} {'rel err':>8}"
    )
    steps = {fp8: decode_step(args, dtype, fp8) for fp8 in caches}
    for name, fp8, tile, rule in candidates:
        q, (k, v, ks, vs), context, nbytes = steps[fp8]
        try:
            backend = make_backend(name, tile, rule)
            ref = TorchAttentionBackend().decode(
                q.float(), k if fp8 else k.float(), v if fp8 else v.float(), context, scale, ks, vs
            )
            out = backend.decode(q, k, v, context, scale, ks, vs)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            ms = median_ms(lambda: backend.decode(q, k, v, context, scale, ks, vs), args.iters)
        except Exception as e:  # a tile that does not fit, or flash-attn missing: report and go on
            print(
                f"{name:<10} {'fp8' if fp8 else 'bf16':<5} {str(tuple(tile or ())):<36} "
                f"{type(e).__name__}: {str(e)[:60]}"
            )
            continue
        label = (str(tuple(tile)) if tile else "default") + (f" split {rule}" if rule else "")
        print(
            f"{name:<10} {'fp8' if fp8 else 'bf16':<5} {label:<36} {ms * 1e3:8.1f} "
            f"{nbytes / ms / 1e6:7.0f} {err:8.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
