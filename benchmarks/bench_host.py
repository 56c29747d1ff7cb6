"""The host's share of bench.py's workload: the engine's own Python (request checks, scheduling,
step inputs, resolving tokens, outputs), timed phase by phase through the engine's profiling hook.

A tiny random model (TINY) runs the whole workload on the CPU, eagerly. For the timed ``generate`` a
hook of ``nanovllm.utils.profiling`` is installed that stamps the start and end of every phase the
engine names. Each phase's own time (its length less the phases nested in it) is summed, and the
phases are split into two kinds:

    host's own work   schedule, inputs, update, outputs, and the Python between phases
                      ("unlabelled")
    device work       forward, sample, wait (here the CPU computes them; on a GPU the host only
                      launches them and, with async scheduling, works on the next step meanwhile)

From the stamps also: the lead (``generate``'s call to the first ``forward``: the device would
wait for it), the tail (the end of the last forward, sample or wait to ``generate``'s return: the
device would be done), and each step's host time (one ``forward``'s start to the next one's, less
the device work started in between), by quarter of the run. Steps late in the run decode few
sequences: there a GPU's step is short, and the host's fixed cost per step shows.

    python benchmarks/bench_host.py                # 256 requests (about 6 minutes on 2 CPU cores)
    python benchmarks/bench_host.py --num-seqs 64  # quicker (lead and tail not the workload's)
    python benchmarks/bench_host.py --profile      # and the cProfile of the timed generate (top 25)

Run it from the repository root as ``python benchmarks/bench_host.py ...``. It imports ``bench``
(``bench.py``'s workload) through the repository root, which the first lines below put on
``sys.path``; tools of this folder import each other by their plain names (a script's own
folder is on ``sys.path``).
"""

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.py

HOST_PHASES = ("schedule", "inputs", "update", "outputs")  # the engine's own work
DEVICE_PHASES = ("forward", "sample", "wait")  # work a GPU would do (or the host's wait for it)
UNLABELLED = "(unlabelled)"  # the engine's Python between phases
STEP = "forward"  # a step starts with its forward
# the "tiny" shape made cheaper still (one layer, a vocabulary just above the workload's token ids
# 0-9,999): the CPU's forward and sampling, mostly the torch backend's attention, still take most
# of the run, but minutes rather than an hour; their time is taken out of the host's figures
TINY = dict(num_hidden_layers=1, vocab_size=10240, bos_token_id=10238, eos_token_id=10239)


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # seconds, on the recorder's clock
    end: float
    depth: int  # 0: not inside another phase


class PhaseRecorder:
    """A hook for ``phase_hook``: records every phase as a ``Span`` (one thread: phases nest)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.spans: list[Span] = []
        self.depth = 0

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        depth, self.depth = self.depth, self.depth + 1
        start = self.clock()
        try:
            yield
        finally:
            self.depth = depth
            self.spans.append(Span(name, start, self.clock(), depth))


@dataclass
class HostReport:
    wall: float  # seconds from generate's call to its return
    own: dict[
        str, float
    ]  # phase -> seconds of its own (nested phases taken out); UNLABELLED included
    counts: dict[str, int]  # phase -> times entered
    lead: float | None  # the call to the first STEP (None: no step recorded)
    tail: float | None  # the end of the last device phase to the return
    steps: list[float] = field(default_factory=list)  # host seconds of each step but the last

    @property
    def host(self) -> float:
        return sum(t for name, t in self.own.items() if name not in DEVICE_PHASES)

    @property
    def device(self) -> float:
        return sum(t for name, t in self.own.items() if name in DEVICE_PHASES)


def own_times(spans: list[Span]) -> list[tuple[Span, float]]:
    """Each span with its own seconds: its length less that of the spans directly inside it."""
    ordered = sorted(spans, key=lambda s: (s.start, s.depth))
    own = [s.end - s.start for s in ordered]
    open_: list[int] = []  # open_[d]: index of the latest span of depth d
    for i, span in enumerate(ordered):
        del open_[span.depth :]
        if span.depth:
            own[open_[span.depth - 1]] -= span.end - span.start
        open_.append(i)
    return list(zip(ordered, own))


def host_report(spans: list[Span], start: float, end: float) -> HostReport:
    """Summarise the spans of one ``generate`` called at ``start`` that returned at ``end``."""
    own: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    by_span = own_times(spans)
    for span, seconds in by_span:
        own[span.name] += seconds
        counts[span.name] += 1
    own[UNLABELLED] = (end - start) - sum(s.end - s.start for s in spans if s.depth == 0)
    counts[UNLABELLED] = 0
    steps = sorted(s.start for s in spans if s.name == STEP)
    if not steps:
        return HostReport(end - start, dict(own), dict(counts), None, None)
    device_in_step = [0.0] * len(steps)  # device phases' own seconds, by the step they started in
    for span, seconds in by_span:
        if span.name in DEVICE_PHASES:
            device_in_step[max(bisect_right(steps, span.start) - 1, 0)] += seconds
    host_steps = [b - a - device_in_step[i] for i, (a, b) in enumerate(zip(steps, steps[1:]))]
    tail = end - max(s.end for s in spans if s.name in DEVICE_PHASES)
    return HostReport(end - start, dict(own), dict(counts), steps[0] - start, tail, host_steps)


def format_report(report: HostReport) -> str:
    """The phases' own times (host's work, then device work), lead, tail and steps by quarter."""
    wall = report.wall or float("nan")
    lines = ["| phase | kind | own time | share of wall | entered |", "|---|---|---|---|---|"]
    host = [
        n
        for n in (
            *HOST_PHASES,
            *sorted(set(report.own) - {*HOST_PHASES, *DEVICE_PHASES, UNLABELLED}),
            UNLABELLED,
        )
        if n in report.own
    ]
    for name in host + [n for n in DEVICE_PHASES if n in report.own]:
        kind = "device" if name in DEVICE_PHASES else "host"
        seconds = report.own[name]
        lines.append(
            f"| {name} | {kind} | {seconds:.3f} s | {seconds / wall:.1%} | "
            f"{report.counts.get(name) or ''} |"
        )
    lines.append(f"| host's own work | | {report.host:.3f} s | {report.host / wall:.1%} | |")
    lines.append(f"| device work | | {report.device:.3f} s | {report.device / wall:.1%} | |")
    lines.append(f"| wall | | {report.wall:.3f} s | | |")
    if report.lead is None:
        lines.append(
            "no forward phase recorded: does the engine call nanovllm.utils.profiling.phase?"
        )
        return "\n".join(lines)
    lines.append(
        f"lead {report.lead:.4f} s (call to the first forward), tail {report.tail:.4f} s "
        f"(end of the last device phase to the return), {len(report.steps) + 1} steps"
    )
    steps, parts = report.steps, min(4, len(report.steps))
    for i in range(parts):  # by quarter of the run (fewer parts when there are fewer steps)
        lo, hi = i * len(steps) // parts, (i + 1) * len(steps) // parts
        part = steps[lo:hi]
        lines.append(
            f"steps {lo + 1}-{hi}: host time per step median "
            f"{statistics.median(part) * 1e3:.2f} ms, "
            f"max {max(part) * 1e3:.2f} ms"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-seqs", type=int, default=256, help="requests of bench.py's workload")
    parser.add_argument(
        "--profile", action="store_true", help="print the cProfile of the timed generate"
    )
    args = parser.parse_args()
    import torch

    from bench import workload
    from nanovllm import LLM
    from nanovllm.utils.checkpoint import make_random_checkpoint
    from nanovllm.utils.profiling import phase_hook

    recorder = PhaseRecorder()
    profile = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory(prefix="nanovllm-host-") as tmp:
        path = make_random_checkpoint(tmp, "tiny", dtype=torch.float32, **TINY)
        with LLM(path, device="cpu", enforce_eager=True, max_model_len=4096) as llm:
            prompts, params = workload(args.num_seqs)
            llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
            with phase_hook(recorder):
                if profile:
                    profile.enable()
                start = recorder.clock()
                llm.generate(prompts, params, use_tqdm=False)
                end = recorder.clock()
                if profile:
                    profile.disable()
    tokens = sum(p.max_tokens for p in params)
    print(
        f"{args.num_seqs} requests, {tokens} output tokens; tiny random model, CPU, eager; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(format_report(host_report(recorder.spans, start, end)))
    if profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
