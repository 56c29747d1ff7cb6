"""bench_lead.py: the gaps before a step's first ops, and the host's part in them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_lead import format_starts, step_starts  # noqa: E402


def test_step_starts_split_each_gap_into_host_late_and_queued():
    calls = {
        1: (0.0, "cudaGraphLaunch"),
        2: (5.0, "cudaMemcpyAsync"),  # queued before the graph's end at 10
        3: (16.0, "cudaMemcpyAsync"),  # called 3 after the copy to host ended at 13: host-late
        4: (17.0, "cudaGraphLaunch_v10000"),
    }
    gpu = [
        (20.0, 22.0, 3, "Memcpy HtoD (Pinned -> Device)"),
        (1.0, 4.0, 1, "kernel_a"),  # the first op: no gap before it to count
        (3.0, 10.0, 1, "kernel_b"),  # the same launch's second kernel: not a first one
        (12.0, 13.0, 2, "Memcpy DtoH (Device -> Pinned)"),
        (30.0, 31.0, 4, "kernel_a"),
        (31.0, 32.0, 4, "kernel_b"),
        (40.0, 41.0, 9, "kernel_c"),  # its call unknown: left out
    ]
    assert step_starts(gpu, calls) == {
        "copy to host": [(2.0, 0.0, 7.0)],
        "copy to device": [(7.0, 3.0, 4.0)],
        "graph's first kernel": [(8.0, 0.0, 13.0)],
    }
    table = format_starts(step_starts(gpu, calls)).splitlines()
    assert table[1].split()[-4:] == ["1", "2.00", "0.00", "7.0"]
    assert table[3].split()[-4:] == ["1", "8.00", "0.00", "13.0"]
    assert step_starts([], calls) == {}


def test_step_starts_measure_from_the_latest_end_so_far():
    calls = {1: (0.0, "cudaLaunchKernel"), 2: (0.0, "cudaMemcpyAsync")}
    gpu = [(0.0, 10.0, 1, "long"), (2.0, 3.0, 1, "short"), (11.0, 12.0, 2, "Memcpy DtoH")]
    assert step_starts(gpu, calls) == {"copy to host": [(1.0, 0.0, 11.0)]}
