"""bench_step.py: what each kernel of a decode step adds, from (name, start, end) records."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_step import added_by_label, added_times, format_positions, position_medians, split_steps  # noqa: E402


def test_added_times_count_only_what_passes_the_latest_end():
    records = [
        ("b", 1.0, 4.0),  # starts before a ends (a dependent launch): adds 4 - 2
        ("a", 0.0, 2.0),  # the first record adds its duration
        ("c", 3.0, 3.5),  # ends inside b: adds nothing
        ("d", 6.0, 7.0),  # after a gap: the gap counts
    ]
    assert added_times(records) == [
        ("a", 2.0, 2.0),
        ("b", 2.0, 3.0),
        ("c", 0.0, 0.5),
        ("d", 3.0, 1.0),
    ]
    rows = added_times(records)
    assert sum(added for _, added, _ in rows) == 7.0  # the span, first start to last end
    assert added_times([]) == []


def test_split_steps_after_each_run_of_draws():
    names = ["copy", "x", "draw", "draw2", "copy", "y", "draw", "copy", "z"]
    rows = [(n, 1.0, 1.0) for n in names]
    steps = split_steps(rows, lambda name: name.startswith("draw"))
    assert [[r[0] for r in step] for step in steps] == [
        ["copy", "x", "draw", "draw2"],
        ["copy", "y", "draw"],
    ]  # the unfinished last step is left out
    assert split_steps([], lambda name: True) == []


def test_position_medians_over_the_commonest_length():
    step = lambda *added: [(f"k{i}", a, 2 * a) for i, a in enumerate(added)]  # noqa: E731
    steps = [step(1.0, 5.0), step(3.0, 6.0), step(2.0, 7.0), step(9.0, 9.0, 9.0)]
    positions, count = position_medians(steps)
    assert count == 3  # the 3-kernel step (a prefill, say) is left out
    assert positions == [("k0", 2.0, 4.0), ("k1", 6.0, 12.0)]
    assert position_medians([]) == ([], 0)


def test_added_by_label_sums_largest_first():
    positions = [("lin1", 5.0, 6.0), ("norm", 1.0, 5.0), ("lin2", 4.0, 9.0)]
    label = lambda name: "linear" if name.startswith("lin") else name  # noqa: E731
    assert list(added_by_label(positions, label).items()) == [("linear", 9.0), ("norm", 1.0)]


def test_format_positions_shows_head_tail_and_total():
    positions = [(f"kernel_{i}", 1e-6 * (i + 1), 2e-6) for i in range(30)]
    text = format_positions(positions, 77, head=3, tail=2, width=8)
    lines = text.splitlines()
    assert lines[0] == "a decode step, kernel by kernel (median of 77 steps of 30):"
    assert lines[1].split() == ["0", "kernel_0", "adds", "1.00", "us", "(runs", "2.00)"]
    assert lines[4] == "  ... 25 more"
    assert lines[5].split()[:2] == ["28", "kerne..."]  # names cut to the width
    assert lines[-1] == f"  the step: {sum(range(1, 31)):.1f} us"
    assert len(lines) == 1 + 3 + 1 + 2 + 1


@pytest.mark.parametrize("head, tail", [(0, 0), (50, 50)])
def test_format_positions_edges(head, tail):
    positions = [("a", 1e-6, 1e-6), ("b", 2e-6, 1e-6)]
    text = format_positions(positions, 1, head=head, tail=tail)
    shown = [line for line in text.splitlines() if "adds" in line]
    assert len(shown) == (0 if head == tail == 0 else 2)
    assert ("... 2 more" in text) == (head == tail == 0)
