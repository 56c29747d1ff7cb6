"""Decode attention alone, on one decode step's shape: time per call and the KV bandwidth it reaches.

The cache is paged (block size 256, block ids shuffled) and filled with N(0, 1) rows; each of the
``--num-seqs`` sequences has a context length drawn uniformly from [--min-len, --max-len] (seed 0);
the defaults resemble a mid-run step of ``bench.py``'s workload. Every candidate is first checked
against the torch backend in float32 over the same cache (dequantized for FP8), then timed with CUDA
events (median of --iters calls after warm-up). "GB/s" counts the K/V bytes the step must read
(and the scales of an FP8 cache) over the median time. GPU only.

    python bench_attention.py                       # flash-attn, Triton bf16 and FP8 at their defaults
    python bench_attention.py --sweep               # also every Triton tile of SWEEP
    python bench_attention.py --heads 32 --kv-heads 4
    python bench_attention.py --cache fp8 --tile 256,2,4 --tile 128,3,4   # given tiles
"""
import argparse
import itertools
import statistics

import torch

from nanovllm.layers.attention import FP8_DTYPE, KV_SCALE_DTYPE, get_attention_backend
from nanovllm.layers.attention_torch import TorchAttentionBackend
from nanovllm.layers.attention_triton import DecodeTile, TritonAttentionBackend
from nanovllm.layers.kv_store import store_kvcache
from nanovllm.utils.context import Context

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
        tables[i, :n] = ids[start:start + n]
        start += n
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k = torch.randn(shape, generator=gen).to("cuda", dtype)
    v = torch.randn(shape, generator=gen).to("cuda", dtype)
    q = torch.randn(args.num_seqs, args.heads, args.head_dim, generator=gen).to("cuda", dtype)
    context = Context(context_lens=lens.to("cuda", torch.int32), block_tables=tables.cuda())
    rows = int(lens.sum()) * args.kv_heads
    if not fp8:
        return q, (k, v, None, None), context, rows * args.head_dim * 2 * dtype.itemsize
    k8, v8 = torch.empty(shape, dtype=FP8_DTYPE, device="cuda"), torch.empty(shape, dtype=FP8_DTYPE, device="cuda")
    ks, vs = (torch.empty(shape[:3], dtype=KV_SCALE_DTYPE, device="cuda") for _ in range(2))
    slots = torch.arange(num_blocks * args.block_size, dtype=torch.int32, device="cuda")
    store_kvcache(k.flatten(0, 1), v.flatten(0, 1), k8, v8, slots, ks, vs)
    return q, (k8, v8, ks, vs), context, rows * (args.head_dim * 2 + 2 * ks.element_size())


def median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1600)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sweep", action="store_true", help="also time every Triton tile of SWEEP")
    parser.add_argument("--cache", choices=("bf16", "fp8", "both"), default="both", help="which caches to time")
    parser.add_argument("--tile", action="append", default=[], metavar="BLOCK_N,STAGES,WARPS",
                        help="also time this Triton tile (repeatable)")
    args = parser.parse_args()
    dtype, scale = torch.bfloat16, args.head_dim**-0.5

    caches = {"bf16": (False,), "fp8": (True,), "both": (False, True)}[args.cache]
    candidates = [("flash-attn", False, None)] if False in caches else []
    candidates += [("triton", fp8, None) for fp8 in caches]
    if args.sweep:
        tiles = [DecodeTile(*t) for t in itertools.product(*SWEEP.values())]
        candidates += [("triton", fp8, tile) for fp8 in caches for tile in tiles]
    given = [DecodeTile(*map(int, t.split(","))) for t in args.tile]
    candidates += [("triton", fp8, tile) for fp8 in caches for tile in given]
    print(f"{args.num_seqs} seqs, contexts {args.min_len}-{args.max_len}, {args.heads} heads / {args.kv_heads} KV heads,"
          f" head_dim {args.head_dim}, block size {args.block_size}, {torch.cuda.get_device_name()}")
    print(f"{'backend':<10} {'cache':<5} {'tile (block_n, stages, warps)':<36} {'us':>8} {'GB/s':>7} {'rel err':>8}")
    steps = {fp8: decode_step(args, dtype, fp8) for fp8 in caches}
    for name, fp8, tile in candidates:
        q, (k, v, ks, vs), context, nbytes = steps[fp8]
        try:
            backend = get_attention_backend(name) if tile is None else TritonAttentionBackend(decode_tile=tile)
            ref = TorchAttentionBackend().decode(q.float(), k if fp8 else k.float(), v if fp8 else v.float(),
                                                 context, scale, ks, vs)
            out = backend.decode(q, k, v, context, scale, ks, vs)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            ms = median_ms(lambda: backend.decode(q, k, v, context, scale, ks, vs), args.iters)
        except Exception as e:  # a tile that does not fit, or flash-attn missing: report and go on
            print(f"{name:<10} {'fp8' if fp8 else 'bf16':<5} {str(tuple(tile or ())):<36} {type(e).__name__}: {str(e)[:60]}")
            continue
        label = str(tuple(tile)) if tile else "default"
        print(f"{name:<10} {'fp8' if fp8 else 'bf16':<5} {label:<36} {ms * 1e3:8.1f} {nbytes / ms / 1e6:7.0f} {err:8.1e}",
              flush=True)


if __name__ == "__main__":
    main()
