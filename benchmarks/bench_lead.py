"""Whether the host keeps ahead of decode at batch 1: for the ops that begin a step (the last
tokens' copy to the host, the inputs' copy to the device, a decode graph's first kernel), the gap
since the device's previous work ended, the part of it the host caused (its queuing call began
after that end), and how long the op sat queued. One call of one request is profiled with CPU and
CUDA activity; the profiler slows the host, so the host-late part is an upper bound.

    python benchmarks/bench_lead.py --random qwen3-0.6b [--backend triton] [--steps 300]
"""

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

KINDS = ("copy to host", "copy to device", "graph's first kernel")


def step_starts(gpu: list[tuple], calls: dict[int, tuple[float, str]]) -> dict[str, list]:
    """``gpu``: device work as (start, end, correlation id, name), any order; ``calls``:
    correlation id -> (start, name) of the CUDA call that queued it. Returns, by kind, one (gap,
    host-late part, time queued) per op; ops without a known call are left out."""
    out, graphs, latest_end = defaultdict(list), set(), None
    for start, end, corr, name in sorted(gpu):
        call = calls.get(corr)
        kind = None
        if "DtoH" in name:
            kind = KINDS[0]
        elif "HtoD" in name:
            kind = KINDS[1]
        elif call is not None and call[1].startswith("cudaGraphLaunch") and corr not in graphs:
            kind = KINDS[2]
            graphs.add(corr)
        if kind is not None and call is not None and latest_end is not None:
            late = max(0.0, min(call[0], start) - latest_end)
            out[kind].append((start - latest_end, late, start - call[0]))
        latest_end = end if latest_end is None else max(latest_end, end)
    return dict(out)


def format_starts(starts: dict[str, list]) -> str:
    lines = [f"{'op':22} {'ops':>5} {'gap us':>8} {'host-late us':>13} {'queued us':>10}"]
    for kind in KINDS:
        rows = starts.get(kind, [])
        if rows:
            gap, late, queued = (statistics.median(r[i] for r in rows) for i in range(3))
            lines.append(f"{kind:22} {len(rows):5d} {gap:8.2f} {late:13.2f} {queued:10.1f}")
    lines.append("(medians, microseconds)")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random", required=True, help="a shape bench.py knows, e.g. qwen3-0.6b")
    parser.add_argument("--backend", default="auto", help="attention backend")
    parser.add_argument("--steps", type=int, default=300, help="output tokens of the call")
    args = parser.parse_args(argv)
    import torch
    from bench_profile import work_and_calls
    from torch.profiler import ProfilerActivity, profile

    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.checkpoint import make_random_checkpoint

    params = SamplingParams(temperature=1.0, max_tokens=args.steps, ignore_eos=True)
    prompt = [list(range(1000, 1128))]
    with tempfile.TemporaryDirectory(prefix="nanovllm-lead-") as tmp:
        path = make_random_checkpoint(tmp, args.random, torch.bfloat16, weights=False)
        kwargs = dict(load_format="dummy", attention_backend=args.backend)
        with LLM(path, max_model_len=args.steps + 256, **kwargs) as llm:
            llm.generate(prompt, params, use_tqdm=False)  # warm-up
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.generate(prompt, params, use_tqdm=False)
                torch.cuda.synchronize()
    gpu, calls, _ = work_and_calls(prof.profiler.kineto_results.events(), unit=1e-3)  # us
    print(f"{args.random}, one request of {args.steps} tokens, {args.backend} backend:")
    print(format_starts(step_starts(gpu, calls)))


if __name__ == "__main__":
    main()
