"""bench_idle's attribution of idle gaps to the host's phases, on synthetic intervals (no GPU)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [
    str(ROOT),
    str(ROOT / "benchmarks"),
]  # bench.py at the repo root, bench_idle.py in benchmarks/

from bench_idle import host_late_idle  # noqa: E402

MS = 1e-3


def test_host_late_gap_split_among_nested_labels():
    # kernel 1 [0, 1] ms, then nothing until kernel 2 at 4 ms, queued by a call at 3.5 ms
    gpu = [(0 * MS, 1 * MS, 1), (4 * MS, 5 * MS, 2)]
    launches = {1: -1 * MS, 2: 3.5 * MS}
    labels = [(0.5 * MS, 3.6 * MS, "@run"), (2 * MS, 3 * MS, "@prepare")]
    late, by_stack, in_time = host_late_idle(gpu, launches, labels)
    assert late == 1 and in_time == 0
    assert by_stack.keys() == {"@run", "@run > @prepare"}
    assert by_stack["@run"] == pytest.approx(
        1.5 * MS
    )  # [1, 2] and [3, 3.5]; after 3.5 the work was queued
    assert by_stack["@run > @prepare"] == pytest.approx(1 * MS)


def test_gap_with_work_queued_in_time_is_not_the_hosts():
    gpu = [(0, 1 * MS, 1), (2 * MS, 3 * MS, 2)]
    late, by_stack, in_time = host_late_idle(gpu, {2: 0.5 * MS}, [(0, 3 * MS, "@run")])
    assert late == 0 and by_stack == {} and in_time == pytest.approx(1 * MS)


def test_short_gaps_overlaps_and_unlabelled_time():
    # overlapping kernels merge; a 50 us gap is ignored; the 2 ms gap has no label before 2.5 ms
    gpu = [(0, 1 * MS, 1), (0.5 * MS, 1.2 * MS, 2), (1.25 * MS, 1.5 * MS, 3), (3.5 * MS, 4 * MS, 4)]
    launches = {3: 0, 4: 3 * MS}
    late, by_stack, in_time = host_late_idle(gpu, launches, [(2.5 * MS, 5 * MS, "@schedule")])
    assert late == 1 and in_time == 0
    assert by_stack["(unlabelled)"] == pytest.approx(1 * MS)
    assert by_stack["@schedule"] == pytest.approx(0.5 * MS)
