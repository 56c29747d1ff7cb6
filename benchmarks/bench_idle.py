"""Why the GPU idles in bench.py's workload: for every idle gap of at least 100 us, whether the host
queued the next work late, and what the host was doing meanwhile.

The timed ``generate`` runs under ``torch.profiler`` with CPU and CUDA activity, with a hook of
``nanovllm.utils.profiling`` installed for the run: every phase the engine names (schedule, inputs,
forward, sample, wait, update, outputs) becomes a ``record_function`` range "@phase", and garbage
collections become "@gc0".."@gc2". A gap is "host-late" when the CUDA call that queued the first
work after it started after the gap began: the device had nothing queued. Its length up to that
call is charged to the innermost phases open meanwhile ("(unlabelled)": the engine's Python
between phases). CPU activity slows the host, so the idle share here is an upper bound of an
unprofiled run's (``bench.py --profile`` records CUDA activity only). Rank 0's host only: worker
processes (tensor parallelism) are not hooked.

    python benchmarks/bench_idle.py --random qwen3-0.6b [--backend triton] [--kv-cache-dtype fp8]
    python benchmarks/bench_idle.py --model /path/to/checkpoint

Run it from the repository root as ``python benchmarks/bench_idle.py ...``. It imports ``bench``
(``bench.py``'s workload) through the repository root, which the first lines below put on
``sys.path``; tools of this folder import each other by their plain names (a script's own
folder is on ``sys.path``).
"""

import argparse
import gc
import sys
import tempfile
import time
from bisect import bisect_left
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.py

from bench_profile import NOT_WORK, format_table, summarize, work_and_calls  # noqa: E402

MIN_GAP = 100e-6  # seconds: shorter gaps are kernel boundaries inside graphs and launch queues


def host_late_idle(
    gpu: list[tuple],
    launches: dict[int, float],
    labels: list[tuple[float, float, str]],
    min_gap: float = MIN_GAP,
):
    """``gpu``: device work as (start, end, correlation id, ...); ``launches``: correlation id ->
    start of the CUDA call that queued it; ``labels``: host ranges (start, end, name). Returns the
    number of host-late gaps of at least ``min_gap``, their seconds (until the queuing call) by the
    stack of labels open meanwhile, outermost first and " > "-joined ("(unlabelled)" where none
    is), and the seconds of the other such gaps (their work was queued in time, or its call is
    unknown)."""
    busy: list[list] = []  # merged intervals, each with the correlation id of its first work
    for start, end, corr, *_ in sorted(gpu):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end, corr])
    labels = sorted(labels)
    starts = [s for s, _, _ in labels]
    longest = max((e - s for s, e, _ in labels), default=0.0)
    by_stack: dict[str, float] = defaultdict(float)
    late, in_time = 0, 0.0
    for (_, gap_start, _), (gap_end, _, corr) in zip(busy, busy[1:]):
        if gap_end - gap_start < min_gap:
            continue
        queued = launches.get(corr)
        if queued is None or queued <= gap_start:
            in_time += gap_end - gap_start
            continue
        late += 1
        a, b = gap_start, min(queued, gap_end)
        open_ = [
            (s, e, n)
            for s, e, n in labels[bisect_left(starts, a - longest) : bisect_left(starts, b)]
            if e > a and s < b
        ]
        cuts = sorted({a, b} | {max(a, s) for s, _, _ in open_} | {min(b, e) for _, e, _ in open_})
        for x, y in zip(cuts, cuts[1:]):
            inner = [
                n for s, e, n in open_ if s <= x and e >= y
            ]  # outermost first: labels sort by start
            by_stack[" > ".join(inner) or "(unlabelled)"] += y - x
    return late, dict(by_stack), in_time


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--random", metavar="SHAPE", default=None, help="a random checkpoint of this shape"
    )
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--top", type=int, default=15, help="label stacks to print")
    args = parser.parse_args()
    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from bench import workload
    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.checkpoint import make_random_checkpoint
    from nanovllm.utils.profiling import phase_hook

    tmp = tempfile.TemporaryDirectory(prefix="nanovllm-idle-")
    path = args.model or make_random_checkpoint(
        tmp.name, args.random or "qwen3-0.6b", dtype=torch.bfloat16
    )
    open_gc = []

    def on_gc(phase, info):  # collections as labels too
        if phase == "start":
            open_gc.append(record_function(f"@gc{info['generation']}"))
            open_gc[-1].__enter__()
        elif open_gc:
            open_gc.pop().__exit__(None, None, None)

    prompts, params = workload(256)
    with LLM(path, attention_backend=args.backend, kv_cache_dtype=args.kv_cache_dtype) as llm:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
        torch.cuda.synchronize()
        gc.callbacks.append(on_gc)
        try:
            with (
                profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
                phase_hook(lambda name: record_function("@" + name)),
            ):
                wall = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
                wall = time.perf_counter() - wall
        finally:
            gc.callbacks.remove(on_gc)
    gpu, calls, labels = work_and_calls(prof.profiler.kineto_results.events(), skip=NOT_WORK)
    names = [(name, start, end) for start, end, _, name in gpu]
    launches = {corr: start for corr, (start, _) in calls.items()}
    total = sum(p.max_tokens for p in params)
    print(f"profiled run (CPU and CUDA activity): {wall:.2f} s, {total / wall:,.0f} tok/s")
    print(format_table(summarize(names, wall)))
    if all(name.startswith("@gc") for _, _, name in labels):
        print(
            "note: the engine named no phases in this run (nanovllm.utils.profiling.phase): "
            "idle is charged to garbage collection or left unlabelled"
        )
    late, by_stack, in_time = host_late_idle(gpu, launches, labels)
    print(
        f"gaps >= {MIN_GAP * 1e6:.0f} us: {late} host-late "
        f"({sum(by_stack.values()):.3f} s until the host queued the next work); "
        f"{in_time:.3f} s in gaps whose next work was queued in time"
    )
    print("host-late idle by what the host was doing (innermost label last):")
    for stack, seconds in sorted(by_stack.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {seconds * 1e3:8.1f} ms  {stack}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
