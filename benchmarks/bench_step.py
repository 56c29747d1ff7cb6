"""What each kernel of a decode step adds to the step's wall time, position by position.

Under programmatic dependent launch a kernel starts before the one ahead of it ends, so kernel
durations overlap and overstate what each costs. What a record *adds* is its end minus the latest
end before it (zero where it ends earlier): these add up to the records' span, and in one stream
each is the kernel's work after its predecessor finished plus the gap before it. Steps are cut
after each run of sampler kernels (the draw ends a step); the steps of the most common length are
the steady state's decode steps, and each position's median over them says what that kernel
costs. ``bench_latency.py --profile`` prints it; the functions are pure (tested on the CPU).
"""

import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

Row = tuple[str, float, float]  # (name, seconds added, seconds of duration)


def added_times(records: Iterable[tuple[str, float, float]]) -> list[Row]:
    """``(name, added, duration)`` per ``(name, start, end)`` record, in start order."""
    rows, latest = [], None
    for name, start, end in sorted(records, key=lambda r: (r[1], r[2])):
        before = start if latest is None else latest
        rows.append((name, max(0.0, end - before), end - start))
        latest = end if latest is None else max(latest, end)
    return rows


def split_steps(rows: list[Row], ends_step: Callable[[str], bool]) -> list[list[Row]]:
    """``rows`` cut after each run of rows whose name ``ends_step``; an unfinished last step is
    left out."""
    steps, current = [], []
    for i, row in enumerate(rows):
        current.append(row)
        next_ends = i + 1 < len(rows) and ends_step(rows[i + 1][0])
        if ends_step(row[0]) and not next_ends:
            steps.append(current)
            current = []
    return steps


def position_medians(steps: list[list[Row]]) -> tuple[list[Row], int]:
    """Per position, the median added and duration over the steps of the most common length
    (the first of them names the position); and how many steps that is."""
    if not steps:
        return [], 0
    length = Counter(map(len, steps)).most_common(1)[0][0]
    alike = [step for step in steps if len(step) == length]
    medians = [
        (
            alike[0][i][0],
            statistics.median(step[i][1] for step in alike),
            statistics.median(step[i][2] for step in alike),
        )
        for i in range(length)
    ]
    return medians, len(alike)


def added_by_label(positions: list[Row], label: Callable[[str], str]) -> dict[str, float]:
    """The positions' added seconds summed by ``label(name)``, largest first."""
    sums: dict[str, float] = defaultdict(float)
    for name, added, _ in positions:
        sums[label(name)] += added
    return dict(sorted(sums.items(), key=lambda kv: -kv[1]))


def format_positions(
    positions: list[Row], num_steps: int, head: int = 16, tail: int = 8, width: int = 60
) -> str:
    """The first ``head`` and last ``tail`` positions (µs added, µs of duration), then the step's
    total."""
    lines = [f"a decode step, kernel by kernel (median of {num_steps} steps of {len(positions)}):"]
    n = len(positions)
    shown = sorted(set(range(min(head, n))) | set(range(max(n - tail, 0), n)))
    for before, i in zip([-1] + shown, shown + [n]):
        if i > before + 1:
            lines.append(f"  ... {i - before - 1} more")
        if i == n:
            break
        name, added, duration = positions[i]
        name = name if len(name) <= width else name[: width - 3] + "..."
        lines.append(
            f"  {i:4d} {name:<{width}} adds {added * 1e6:7.2f} us (runs {duration * 1e6:7.2f})"
        )
    total = sum(added for _, added, _ in positions)
    lines.append(f"  the step: {total * 1e6:.1f} us")
    return "\n".join(lines)
