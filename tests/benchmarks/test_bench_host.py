"""bench_host's phase accounting: own times, lead, tail and host time per step, on synthetic spans
with known answers, and the recorder as a hook of nanovllm.utils.profiling (no model needed)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [
    str(ROOT),
    str(ROOT / "benchmarks"),
]  # bench.py at the repo root, bench_host.py in benchmarks/

from bench_host import UNLABELLED, PhaseRecorder, Span, format_report, host_report, own_times  # noqa: E402

from nanovllm.utils.profiling import phase, phase_hook  # noqa: E402

# generate called at 0, returns at 20. Two steps; the first forward has its inputs nested in it.
SPANS = [
    Span("schedule", 1, 2, 0),
    Span("inputs", 2, 3, 1),
    Span("forward", 2, 5, 0),
    Span("sample", 5, 6, 0),
    Span("update", 6, 7, 0),
    Span("outputs", 7, 7.5, 0),
    Span("schedule", 8, 9, 0),
    Span("forward", 9, 12, 0),
    Span("sample", 12, 13, 0),
    Span("wait", 13, 13.5, 0),
    Span("update", 13.5, 14, 0),
    Span("outputs", 15, 16, 0),
]


def test_own_times_take_nested_phases_out():
    spans = [
        Span("a", 0, 10, 0),
        Span("b", 1, 4, 1),
        Span("c", 2, 3, 2),
        Span("d", 5, 6, 1),
        Span("a", 10, 11, 0),
    ]
    own = {
        (s.name, s.start): t for s, t in own_times(list(reversed(spans)))
    }  # recorded innermost first
    assert own == {("a", 0): 6, ("b", 1): 2, ("c", 2): 1, ("d", 5): 1, ("a", 10): 1}


def test_report_splits_host_and_device_work():
    r = host_report(SPANS, 0.0, 20.0)
    assert r.own == {
        "schedule": 2,
        "inputs": 1,
        "forward": 5,
        "sample": 2,
        "wait": 0.5,
        "update": 1.5,
        "outputs": 1.5,
        UNLABELLED: 6.5,
    }
    assert r.counts["forward"] == 2 and r.counts["inputs"] == 1 and r.counts["wait"] == 1
    assert r.device == 7.5  # forward (less its inputs), sample, wait
    assert r.host == 12.5  # schedule, inputs, update, outputs and 6.5 s between phases
    assert r.host + r.device == r.wall == 20
    assert r.lead == 2  # the call to the first forward
    assert r.tail == 6.5  # the end of the last device phase (wait, at 13.5) to the return
    # step 1 runs from 2 to 9: 7 s less its forward's own 2 s and its sample's 1 s
    assert r.steps == [4]


def test_report_without_phases():
    r = host_report([], 0.0, 3.0)
    assert r.lead is None and r.tail is None and r.steps == [] and r.host == 3.0 and r.device == 0
    assert "no forward phase recorded" in format_report(r)


def test_format_report_rows():
    text = format_report(host_report(SPANS, 0.0, 20.0))
    assert "| inputs | host | 1.000 s | 5.0% | 1 |" in text
    assert "| forward | device | 5.000 s | 25.0% | 2 |" in text
    assert f"| {UNLABELLED} | host | 6.500 s | 32.5% |  |" in text
    assert "| host's own work | | 12.500 s | 62.5% | |" in text
    assert "lead 2.0000 s" in text and "tail 6.5000 s" in text and "2 steps" in text
    assert "steps 1-1: host time per step median 4000.00 ms, max 4000.00 ms" in text


def test_recorder_is_a_phase_hook():
    ticks = iter(range(100))
    recorder = PhaseRecorder(clock=lambda: next(ticks))
    with phase_hook(recorder):
        with phase("forward"):
            with phase("inputs"):
                pass
        with pytest.raises(KeyError):
            with phase("sample"):
                raise KeyError("a phase that raises is still recorded, and the depth restored")
        with phase("update"):
            pass
    with phase("outputs"):  # the hook is gone
        pass
    assert recorder.spans == [
        Span("inputs", 1, 2, 1),
        Span("forward", 0, 3, 0),
        Span("sample", 4, 5, 0),
        Span("update", 6, 7, 0),
    ]


def test_engine_phases_on_a_tiny_model(tmp_path):
    """The engine names every step's phases: one forward, sample and wait per step, and the
    spans account for the whole call."""
    import torch
    from bench_host import TINY

    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.checkpoint import make_random_checkpoint
    from nanovllm.utils.profiling import PHASES

    path = make_random_checkpoint(str(tmp_path), "tiny", dtype=torch.float32, **TINY)
    recorder = PhaseRecorder()
    with (
        LLM(path, device="cpu", enforce_eager=True, max_model_len=256) as llm,
        phase_hook(recorder),
    ):
        start = recorder.clock()
        llm.generate(
            [[1, 2, 3], [4, 5, 6, 7, 8]],
            SamplingParams(max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
        end = recorder.clock()
    r = host_report(recorder.spans, start, end)
    assert {s.name for s in recorder.spans} <= set(PHASES)
    assert (
        r.counts["forward"] == r.counts["sample"] == r.counts["wait"] == 4
    )  # one prefill, three decodes
    assert len(r.steps) == 3 and all(t > 0 for t in r.steps)
    assert 0 < r.lead and 0 < r.tail and r.own[UNLABELLED] > 0
    assert r.host + r.device == pytest.approx(r.wall)
