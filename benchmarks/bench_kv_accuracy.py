"""Accuracy of the FP8 KV cache (``kv_cache_dtype="fp8"``) next to a cache in the model's dtype
(bf16).

1. Attention-output error, at Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim
   128), block size 256. Keys K = N(0, 1) times a per-channel scale exp(N(0, sigma)) (a few large
   channels, as real keys have), values V = N(0, 1), one bf16 query q = N(0, 1) per sequence. K/V,
   drawn in float32, are written by the torch backend's ``store_kvcache`` (the Triton store writes
   the same bytes) into a paged cache (random block ids), once bf16 and once FP8, and read by its
   ``decode``. Both are compared with float64 attention over the unrounded K/V and the same q:
   relative L2 error and largest absolute error. The output is bf16: "bf16 output floor" is the
   error of rounding the exact output to bf16 alone.

2. Greedy agreement and next-token KL. A random Qwen3 checkpoint (bf16 weights N(0, std)) runs one
   greedy workload (random token-id prompts, ignore_eos) with a bf16 cache, an FP8 cache, and, as a
   control, a bf16 cache whose K/V get noise of bf16 rounding's own size before storing. A wrapper
   around ``ModelRunner.sample`` (paired with the step's sequences) keeps every sampled row's
   log-softmax. Per prompt, d = the first position where a run's tokens differ from the bf16 run's
   (max_tokens when none): positions 0..d had the same context. Reported: prompts with identical
   completions, d, token agreement over positions 0..d (sum d / sum (d + 1) when all diverge),
   KL(bf16 || other) at positions 0..d, and at each FP8 divergence the log-prob gap between the
   two chosen tokens (a near-tie or not; bf16 logits of this size are 1/16 or 1/8 apart). Position
   0 is computed by prefill from the fresh K/V, not the cache (the prompts share no prefix), so its
   KL is 0; the cache is read from position 1.

    # CPU: the torch backend; GPU: the "auto" backends
    python benchmarks/bench_kv_accuracy.py
    # longer prompts (about 2x the time on a CPU)
    python benchmarks/bench_kv_accuracy.py --max-len 1000
    # part 1 only, keys without large channels
    python benchmarks/bench_kv_accuracy.py --part 1 --sigma 0
    # FP8 weights (and FP8 weights + cache) vs bf16
    python benchmarks/bench_kv_accuracy.py --part 2 --weights

With ``--weights`` part 2 compares FP8 weights quantized at load (``quantization="fp8"``) from the
same bf16 checkpoint, alone and with the FP8 cache, against the bf16 weights, and has no control
run.

Run it from the repository root as ``python benchmarks/bench_kv_accuracy.py ...``; it needs nothing
from ``bench.py`` (the tools that do put the repository root on ``sys.path`` in their first lines).
"""

import argparse
import os
import random
import statistics
import tempfile
import time

import torch
from kv_attention_error import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, attention_error_table

from nanovllm import LLM, SamplingParams
from nanovllm.layers.attention import Attention
from nanovllm.utils.checkpoint import make_random_checkpoint

# ---- 2. greedy agreement and next-token KL (part 1: kv_attention_error.py) ----------------


class RecordDistributions:
    """Keeps the log-softmax (float32, on the host) of every row that samples a token, keyed by
    (prompt token ids, completion position): it wraps the model runner's ``sample`` (the step's
    logits) and the scheduler's ``advance``, which the engine core calls right after launching the
    step with that step's sequences, in the sampler's row order. Needs steps that go through the
    sampler (``logprobs`` set) on one rank."""

    def __init__(self, runner, scheduler):
        self.logprobs: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
        self._last = None
        sample, advance = runner.sample, scheduler.advance

        def record_sample(logits, rows, *rest):
            self._last = torch.log_softmax(logits.float(), dim=-1).cpu()  # [num_seqs, vocab]
            return sample(logits, rows, *rest)

        def record_advance(seqs):
            logprobs, self._last = self._last, None
            for row, seq in enumerate(seqs):
                computed = seq.num_cached_tokens + seq.num_scheduled_tokens
                if computed < len(seq):  # part-way through a chunked prefill: its token is dropped
                    continue
                self.logprobs[(tuple(seq.prompt_token_ids), computed - seq.num_prompt_tokens)] = (
                    logprobs[row].clone()
                )
            return advance(seqs)

        runner.sample, scheduler.advance = record_sample, record_advance


class NoisyStore:
    """Wraps an attention backend: K/V are multiplied by (1 + rel * N(0, 1)) before they are
    stored. rel = 2^-9 is about the rms relative error of rounding to bf16: cache noise of bf16's
    own size."""

    def __init__(self, backend, rel: float):
        self.backend, self.rel = backend, rel

    def store_kvcache(self, k, v, *args):
        k, v = (x * (1 + self.rel * torch.randn(x.shape, device=x.device)) for x in (k, v))
        self.backend.store_kvcache(k, v, *args)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def run_greedy(
    path: str,
    kv_cache_dtype: str,
    prompts: list[list[int]],
    max_tokens: int,
    device: str,
    store_noise: float = 0.0,
    quantization: str | None = None,
):
    """-> completion token ids, next-token log-probs [max_tokens, vocab] (per prompt), throughput"""
    max_len = max(map(len, prompts)) + max_tokens
    blocks = len(prompts) * -(-max_len // BLOCK_SIZE)
    # with noise: eager, as CUDA graphs would keep the backend they captured
    with LLM(
        path,
        device=device,
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=blocks,
        max_model_len=max_len,
        max_num_seqs=len(prompts),
        enforce_eager=store_noise > 0,
        quantization=quantization,
    ) as llm:
        if store_noise:
            torch.manual_seed(0)
            for module in llm.core.executor.runner.model.modules():
                if isinstance(module, Attention):
                    module.backend = NoisyStore(module.backend, store_noise)
        recorder = RecordDistributions(llm.core.executor.runner, llm.core.scheduler)
        # logprobs=0: every step goes through the sampler, not only the CUDA graph's own draw
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        throughput = llm.last_throughput
    logprobs = [
        torch.stack([recorder.logprobs[(tuple(p), j)] for j in range(max_tokens)]) for p in prompts
    ]
    return [o["token_ids"] for o in outputs], logprobs, throughput


def kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    return (logp.double().exp() * (logp.double() - logq.double())).sum().item()


def compare(base, other, n: int) -> tuple[list[str], list[tuple[int, float, float]]]:
    """Greedy agreement and KL(base || other) over the positions with a shared context.
    -> table cells, and (position, log p gap in base, log p gap in other) at each divergence"""
    first_div, kl_first, kl_decode, gaps = [], [], [], []
    for a, la, b, lb in zip(*base, *other):
        d = next((j for j in range(n) if a[j] != b[j]), n)
        first_div.append(d)
        kl_first.append(kl(la[0], lb[0]))
        kl_decode += [kl(la[j], lb[j]) for j in range(1, min(d + 1, n))]
        if d < n:
            gaps.append((d, (la[d][a[d]] - la[d][b[d]]).item(), (lb[d][b[d]] - lb[d][a[d]]).item()))
    compared = sum(min(d + 1, n) for d in first_div)
    return [
        f"{sum(d == n for d in first_div)} / {len(first_div)}",
        f"{statistics.mean(first_div):.1f}",
        " ".join(map(str, sorted(first_div))),
        f"{compared - len(gaps)} / {compared} = {(compared - len(gaps)) / compared:.3f}",
        f"{max(kl_first):.2e}",
        f"{len(kl_decode)}",
        (
            f"{statistics.mean(kl_decode):.2e} / {statistics.median(kl_decode):.2e} / "
            f"{max(kl_decode):.2e}"
        )
        if kl_decode
        else "-",
    ], gaps


def agreement_table(args, device: str) -> None:
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.prompts)]
    prompts = [[rng.randrange(10000) for _ in range(length)] for length in lengths]
    n = args.new_tokens
    if args.weights:  # FP8 weights (quantized at load) against the bf16 weights they come from
        variants = {
            "bf16": ("auto", 0.0, None),
            "fp8 weights": ("auto", 0.0, "fp8"),
            "fp8 weights + fp8 cache": ("fp8", 0.0, "fp8"),
        }
    else:
        variants = {
            "bf16 cache": ("auto", 0.0, None),
            "fp8 cache": ("fp8", 0.0, None),
            "bf16 cache + noise": ("auto", 2**-9, None),
        }
    runs = {}
    with tempfile.TemporaryDirectory() as path:
        make_random_checkpoint(
            path,
            "qwen3-0.6b",
            torch.bfloat16,
            seed=args.seed,
            std=args.std,
            num_hidden_layers=args.layers,
        )
        for name, (kv, noise, quantization) in variants.items():
            start = time.perf_counter()
            tokens, logprobs, speed = run_greedy(path, kv, prompts, n, device, noise, quantization)
            runs[name] = tokens, logprobs
            print(
                f"[{name}: {time.perf_counter() - start:.0f} s; "
                f"prefill {speed['prefill']:.0f} tok/s, "
                f"decode {speed['decode']:.0f} tok/s]"
            )
    # the recorded rows must be the ones the sampler chose from: greedy picks their argmax
    consistent = sum(
        lp[j].argmax().item() == toks[j]
        for run in runs.values()
        for toks, lp in zip(*run)
        for j in range(n)
    )
    base_name, *others = variants
    base = runs[base_name]
    cells = {name: compare(base, runs[name], n) for name in others}
    gaps = cells[others[0]][1]
    top = [lp[j].topk(2).values for lp in base[1] for j in range(n)]
    top1, top_gaps = [t[0].exp().item() for t in top], [(t[0] - t[1]).item() for t in top]
    what = "bf16 weights" if args.weights else "the bf16 cache"
    control = (
        ""
        if args.weights
        else "; control: bf16 cache with K/V times (1 + 2^-9 N(0, 1)) before storing"
    )
    print(
        f"\n### Greedy agreement and next-token KL against {what} ({device}; random Qwen3 weights, "
        f"N(0, {args.std}) in bf16: {args.layers} layers, hidden 1024, intermediate 3072, "
        f"{NUM_HEADS} heads, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, vocab 151936, "
        f"tied embeddings; {args.prompts} prompts of {args.min_len}-{args.max_len} random "
        f"token ids, {n} greedy tokens each, ignore_eos{control})\n"
    )
    print(
        f"recorded distributions whose argmax is the emitted token: {consistent} / "
        f"{len(runs) * n * len(prompts)}; "
        f"{base_name} run, all positions: top-1 probability median {statistics.median(top1):.3f} "
        f"(min {min(top1):.3f}, max {max(top1):.3f}), top-1 minus top-2 log-prob median "
        f"{statistics.median(top_gaps):.3f} "
        f"(10th percentile {statistics.quantiles(top_gaps, n=10)[0]:.3f})\n"
    )
    print(f"| metric | {' | '.join(others)} |\n|---|{'---:|' * len(others)}")
    names = [
        "prompts whose completions are identical",
        f"first divergence position d, mean ({n} when none)",
        "d per prompt (sorted)",
        "token agreement over positions 0..d",
        "KL at position 0 (prefill), max",
        "KL at decode positions 1..d: count",
        "KL at decode positions 1..d: mean / median / max (nats)",
    ]
    for i, name in enumerate(names):
        print(f"| {name} | {' | '.join(cells[o][0][i] for o in others)} |")
    if gaps:
        print(
            f"\n| {others[0]}: divergence at position "
            f"| log p gap in {base_name} run (its token - the other's) "
            "| log p gap in the other run (its token - the first's) |"
        )
        print("|---:|---:|---:|")
        for d, gap_a, gap_b in sorted(gaps):
            print(f"| {d} | {gap_a:.4f} | {gap_b:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context-lens", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument(
        "--seqs", type=int, default=8, help="sequences per context length in part 1"
    )
    parser.add_argument(
        "--sigma", type=float, default=1.0, help="log-normal sigma of the key channel scales"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--std", type=float, default=0.1, help="standard deviation of the random weights"
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--part", choices=["1", "2", "both"], default="both")
    parser.add_argument(
        "--weights",
        action="store_true",
        help="part 2 compares FP8 weights (quantization='fp8'), alone and with the FP8 cache, "
        "with the bf16 weights",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = (
        torch.cuda.get_device_name() if device == "cuda" else f"CPU, {os.cpu_count()} cores"
    )
    print(f"device: {device_name}; torch {torch.__version__}")
    start = time.perf_counter()
    if args.part in ("1", "both"):
        attention_error_table(device, args.context_lens, args.seqs, args.sigma, args.seed)
    if args.part in ("2", "both"):
        agreement_table(args, device)
    print(f"\n[total {time.perf_counter() - start:.0f} s]")


if __name__ == "__main__":
    main()
