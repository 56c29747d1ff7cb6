"""GPU time of a benchmark run by kernel category and by kernel, and the share of the run the GPU
sat idle.

``bench.py --profile`` runs its timed ``generate`` under ``torch.profiler`` with CUDA activity only
(no CPU ops, shapes or stacks, so the run is barely slowed), turns the device's kernel, memcpy and
memset records into ``(name, start, end)`` intervals, and prints ``summarize(...)`` as a table.
The summary is a pure function of those intervals, tested on the CPU.

A module, not a script: ``bench.py`` imports it as ``benchmarks.bench_profile`` (``bench.py``'s
folder, the repository root, is on ``sys.path``), ``benchmarks/bench_idle.py`` as ``bench_profile``
(a script's own folder is on ``sys.path``). It patches nothing: it reads the profiler's records.
"""

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

# Kernel categories, tried in this order; a kernel belongs to the first category with a pattern
# that its name contains (case-insensitive), else to OTHER. The order matters: flash-attn's
# kernel names contain "cutlass" (its element types), so attention comes before GEMMs.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    # flash-attn: flash_fwd_splitkv_kernel (+ _combine_kernel); Triton: _decode_kernel,
    # _decode_reduce_kernel. A prefill over a cached prefix reads a paged cache, which flash-attn
    # also runs with its splitkv kernel: that time is counted here as decode.
    ("decode attention", ("flash_fwd_splitkv", "decode")),
    # flash-attn: flash_fwd_kernel; Triton: _prefill_kernel
    ("prefill attention", ("flash_fwd_kernel", "prefill")),
    # the fused MoE kernels' two grouped GEMMs, bf16 or FP8
    ("MoE experts", ("_gate_up_kernel", "_down_kernel", "_gate_up_fp8_kernel", "_down_fp8_kernel")),
    # the MoE routing (softmax, top-k, renormalisation) and grouping (counts, offsets, scatter)
    # kernels
    ("MoE routing", ("_select_experts_kernel", "_count_kernel", "_scatter_kernel")),
    # LoRA adapters: the kernel after the GEMM (nanovllm/lora/triton_ops.py; the shrink is in it)
    ("LoRA", ("_lora_out_kernel",)),
    # the FP8 linears: the activations' quantization and the block-scaled GEMM (Triton's; cuBLAS's,
    # from 128 rows on Hopper, counts under GEMMs)
    ("FP8 linears", ("_fp8_gemm_kernel", "_quantize_kernel")),
    # cuBLAS / cuBLASLt / CUTLASS matrix multiplies (also the LM head)
    ("GEMMs", ("gemm", "sm90_xmma", "cutlass", "cublas", "nvjet")),
    # tensor parallelism: NCCL's kernels (all-reduce, gather, broadcast, all-gather) and the
    # one-shot all-reduce, also the one fused with the residual add and RMSNorm (before the norms:
    # its name contains theirs)
    ("collectives", ("nccl", "_one_shot")),
    # torch.compile'd RMSNorm and SiLU-and-mul (Inductor's Triton kernels; with FP8 weights our
    # kernels that also quantize for the next linear; at a few rows those of layers/few_rows.py);
    # the fused QK-norm, RoPE and KV-cache store of the new tokens
    # (attention.kv_store.rope_and_store: the only KV store on the GPU, so no category of its own)
    (
        "norms / rotary / activation",
        (
            "triton_poi_fused",
            "triton_red_fused",
            "triton_per_fused",
            "_rope_store",
            "_rms_norm_quant_kernel",
            "_silu_mul_quant_kernel",
            "_rms_norm_kernel",  # also _add_rms_norm_kernel
            "_silu_mul_kernel",
        ),
    ),
    # the fused Gumbel-max draw (its chunks, then the best of them); greedy argmax;
    # top-k/top-p/min-p (topk, sort, cumsum, logsumexp); log-probabilities (log_softmax)
    (
        "sampler",
        (
            "gumbel",
            "best_of_",
            "argmax",
            "topk",
            "kthvalue",
            "radix",
            "sort",
            "softmax",
            "logsumexp",
            "devicescan",
            "exponential",
        ),
    ),
    # CUPTI names these "Memcpy HtoD (Pinned -> Device)", "Memset (Device)", ...
    ("copies", ("memcpy", "memset")),
]
OTHER = "other"
IDLE = "GPU idle"
# device records that are waits, not work (kineto's CUDA sync events, when enabled)
NOT_WORK = {"Event Sync", "Stream Sync", "Context Sync", "Stream Wait Event"}


def category(name: str) -> str:
    """The first category of CATEGORIES with a pattern in ``name``, else OTHER."""
    lowered = name.lower()
    for label, patterns in CATEGORIES:
        if any(p in lowered for p in patterns):
            return label
    return OTHER


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``[start, end)`` intervals as sorted, disjoint intervals: overlapping kernels
    (several streams) count once."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(start, end) for start, end in out]


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals."""
    return sum(end - start for start, end in merged(intervals))


# idle gaps between kernels, binned by length (seconds): launch gaps are microseconds, a GPU
# waiting on the host's step preparation hundreds of microseconds or more
GAP_BINS = (10e-6, 100e-6, 1e-3)


def idle_gaps(
    busy: list[tuple[float, float]], parts: int = 10
) -> tuple[list[tuple[int, float]], list[float]]:
    """The idle gaps between the ``merged`` busy intervals: (count, seconds) per length bin of
    GAP_BINS (the last bin open-ended), and the idle seconds in each of ``parts`` equal parts of
    the span from the first start to the last end (a gap across a border is split there)."""
    by_length = [[0, 0.0] for _ in range(len(GAP_BINS) + 1)]
    by_part = [0.0] * parts
    if not busy:
        return [tuple(b) for b in by_length], by_part
    first, width = busy[0][0], (busy[-1][1] - busy[0][0]) / parts
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:]):
        length = gap_end - gap_start
        bin_ = sum(length >= edge for edge in GAP_BINS)
        by_length[bin_][0] += 1
        by_length[bin_][1] += length
        part = min(int((gap_start - first) / width), parts - 1)
        while length > 0:
            part_end = first + (part + 1) * width if part < parts - 1 else gap_end
            step = min(gap_end, part_end) - max(gap_start, first + part * width)
            by_part[part] += step
            length -= step
            part += 1
    return [tuple(b) for b in by_length], by_part


@dataclass
class GpuProfile:
    wall: float  # seconds of the timed region
    busy: float  # seconds during which at least one kernel, memcpy or memset ran
    times: dict[
        str, float
    ]  # category -> summed kernel durations (seconds), in CATEGORIES order, OTHER last
    counts: dict[str, int]  # category -> number of kernels
    top_other: list[tuple[str, float]] = field(
        default_factory=list
    )  # the largest OTHER kernels by time
    # the largest kernels: (name, seconds, calls, shortest call, longest call); a wide spread says
    # the calls are not alike (one kernel name serves prefill and decode shapes, say), so the mean
    # misleads
    top_kernels: list[tuple[str, float, int, float, float]] = field(default_factory=list)
    first: float = 0.0  # the first event's start and the last one's end (the events' clock)
    last: float = 0.0
    gaps_by_length: list[tuple[int, float]] = field(
        default_factory=list
    )  # per GAP_BINS bin: (count, seconds)
    gaps_by_part: list[float] = field(default_factory=list)  # idle seconds per tenth of the span

    @property
    def idle(self) -> float:
        return max(self.wall - self.busy, 0.0)

    @property
    def span(self) -> float:
        return self.last - self.first


def summarize(
    events: Iterable[tuple[str, float, float]], wall: float, num_other: int = 5, num_top: int = 12
) -> GpuProfile:
    """Sum the durations of the ``(name, start, end)`` device events (seconds) per category, and
    per name for the ``num_top`` largest.
    GPU idle is ``wall`` minus the union of all the events' intervals; since kernels on different
    streams may overlap, the category times can add up to more than the busy time."""
    times = {label: 0.0 for label, _ in CATEGORIES} | {OTHER: 0.0}
    counts = dict.fromkeys(times, 0)
    other: dict[str, float] = defaultdict(float)
    per_name: dict[str, list] = defaultdict(
        lambda: [0.0, 0, float("inf"), 0.0]
    )  # seconds, calls, min, max
    intervals = []
    for name, start, end in events:
        if name in NOT_WORK:
            continue
        if end < start:
            raise ValueError(f"event {name!r} ends before it starts ({start} > {end})")
        label = category(name)
        times[label] += end - start
        counts[label] += 1
        if label == OTHER:
            other[name] += end - start
        stats = per_name[name]
        stats[0] += end - start
        stats[1] += 1
        stats[2] = min(stats[2], end - start)
        stats[3] = max(stats[3], end - start)
        intervals.append((start, end))
    top = sorted(other.items(), key=lambda kv: (-kv[1], kv[0]))[:num_other]
    kernels = sorted(
        ((name, *stats) for name, stats in per_name.items()), key=lambda k: (-k[1], k[0])
    )[:num_top]
    busy = merged(intervals)
    first, last = (busy[0][0], busy[-1][1]) if busy else (0.0, 0.0)
    by_length, by_part = idle_gaps(busy)
    return GpuProfile(
        wall,
        sum(e - s for s, e in busy),
        times,
        counts,
        top,
        kernels,
        first,
        last,
        by_length,
        by_part,
    )


def format_table(profile: GpuProfile) -> str:
    """A Markdown table: GPU time and share of wall per category (empty categories left out),
    then GPU idle."""
    lines = ["| | GPU time | share of wall | kernels |", "|---|---|---|---|"]
    wall = profile.wall or float("nan")
    for label, seconds in profile.times.items():
        if profile.counts[label]:
            lines.append(
                f"| {label} | {seconds:.2f} s | {seconds / wall:.1%} | {profile.counts[label]:,} |"
            )
    lines.append(f"| {IDLE} | {profile.idle:.2f} s | {profile.idle / wall:.1%} | |")
    lines.append(f"| wall (profiled) | {profile.wall:.2f} s | | |")
    return "\n".join(lines)


def format_notes(
    profile: GpuProfile, window: tuple[float, float] | None = None, width: int = 100
) -> str:
    """The largest kernels (time, calls, mean, and in brackets the shortest and longest call in µs),
    the largest uncategorised ones (to extend CATEGORIES with) and a coverage check: how much of
    the run the events span, and, given the profiled ``window`` (start, end) on the events' clock,
    how far the first and last events lie from its ends (events that stop well before the end were
    dropped, and the idle share is then too high). Names longer than ``width`` are cut."""

    def short(name: str) -> str:
        return name if len(name) <= width else name[: width - 3] + "..."

    lines = []
    if profile.top_kernels:
        lines.append("largest kernels:")
        for name, seconds, calls, shortest, longest in profile.top_kernels:
            spread = f"({shortest * 1e6:.1f}-{longest * 1e6:.1f})"
            lines.append(
                f"  {seconds:8.3f} s {calls:9,} x {seconds / calls * 1e6:9.2f} us "
                f"{spread:>19}  {short(name)}"
            )
    if profile.top_other:
        lines.append(f"largest '{OTHER}' kernels:")
        for name, seconds in profile.top_other:
            lines.append(f"  {seconds * 1e3:9.1f} ms  {short(name)}")
    lines.append(
        f"kernels span {profile.span:.2f} s of the {profile.wall:.2f} s wall; "
        f"busy (union) {profile.busy:.2f} s"
    )
    if profile.gaps_by_length:
        edges = [f"{edge * 1e6:g}" for edge in GAP_BINS]
        labels = (
            [f"< {edges[0]} us"]
            + [f"{lo}-{hi} us" for lo, hi in zip(edges, edges[1:])]
            + [f">= {edges[-1]} us"]
        )
        cells = [
            f"{label}: {n:,} ({t:.3f} s)" for label, (n, t) in zip(labels, profile.gaps_by_length)
        ]
        lines.append("idle gaps between kernels by length: " + ", ".join(cells))
        lines.append(
            "idle seconds per tenth of the span: "
            + " ".join(f"{t:.3f}" for t in profile.gaps_by_part)
        )
    if window is not None and profile.span:
        lines.append(
            f"first event {profile.first - window[0]:+.3f} s after the profiled window opened, "
            f"last event {window[1] - profile.last:+.3f} s before it closed"
        )
    if profile.wall and profile.span < 0.5 * profile.wall:
        lines.append(
            "warning: device events cover under half the run; the profiler may have dropped records"
        )
    return "\n".join(lines)


def device_events(kineto_events, device_index: int) -> list[tuple[str, float, float]]:
    """``(name, start, end)`` in seconds of one GPU's records (kernels, memcpy, memset) among the
    events of ``prof.profiler.kineto_results.events()``; CPU-side records (runtime calls) are
    left out, and so are ranges of user annotations projected onto the GPU (not work either).
    All GPUs' records when none carries ``device_index``."""
    from torch.autograd import DeviceType

    by_device = defaultdict(list)
    for e in kineto_events:
        if (
            e.device_type() == DeviceType.CUDA
            and not getattr(e, "is_user_annotation", lambda: False)()
        ):
            by_device[e.device_index()].append((e.name(), e.start_ns() * 1e-9, e.end_ns() * 1e-9))
    if device_index in by_device:
        return by_device[device_index]
    return [event for events in by_device.values() for event in events]


def work_and_calls(kineto_events, unit: float = 1e-9, skip=()) -> tuple[list, dict, list]:
    """One pass over ``prof.profiler.kineto_results.events()`` (times: nanoseconds × ``unit``):
    the device's work as (start, end, correlation id, name), leaving out user annotations projected
    onto the GPU and names in ``skip``; the CUDA runtime calls as correlation id -> (start, name);
    the host ranges named "@..." (phase labels) as (start, end, name)."""
    from torch.autograd import DeviceType

    gpu, calls, labels = [], {}, []
    for e in kineto_events:
        start, end, name = e.start_ns() * unit, e.end_ns() * unit, e.name()
        if e.device_type() == DeviceType.CUDA:
            if name not in skip and not getattr(e, "is_user_annotation", lambda: False)():
                gpu.append((start, end, e.correlation_id(), name))
        elif name.startswith("cuda"):
            calls[e.correlation_id()] = (start, name)
        elif name.startswith("@"):
            labels.append((start, end, name))
    return gpu, calls, labels


class GpuProfiler:
    """``with GpuProfiler(trace_path) as p: <timed region>``; then ``p.summary(wall)``. Records
    kineto's CUDA activity of this process, summarised for its current GPU (with tensor
    parallelism: rank 0's); saves a Chrome trace on exit when ``trace_path`` is given."""

    def __init__(self, trace_path: str | None = None):
        self.trace_path = trace_path
        self._prof = None
        self._opened = 0.0
        self.window: tuple[float, float] | None = None  # (start, end), seconds since the epoch

    def __enter__(self):
        import torch
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self._prof = profile(
            activities=[ProfilerActivity.CUDA],
            record_shapes=False,
            profile_memory=False,
            with_stack=False,
        )
        self._prof.__enter__()
        self._opened = time.time_ns() * 1e-9  # kineto stamps events in ns since the epoch
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.synchronize()
        self.window = (self._opened, time.time_ns() * 1e-9)
        self._prof.__exit__(*exc)
        if self.trace_path and exc[0] is None:
            self._prof.export_chrome_trace(self.trace_path)

    def raw_events(self):
        """The profiler's records, for ``device_events``."""
        return self._prof.profiler.kineto_results.events()

    def summary(self, wall: float) -> GpuProfile:
        """The profiled region's kernels summarised against its measured ``wall`` seconds."""
        import torch

        return summarize(device_events(self.raw_events(), torch.cuda.current_device()), wall)
