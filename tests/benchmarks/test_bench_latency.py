"""bench_latency.py's arguments (the timing itself needs a GPU and is not tested)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_latency import parse_args  # noqa: E402


def test_defaults_and_flags():
    args = parse_args(["--random", "qwen3-0.6b"])
    assert (args.prompt_len, args.steps, args.repeats, args.temperature) == (128, 256, 5, 0.0)
    assert (args.profile, args.enforce_eager, args.quantization) == (False, False, None)
    args = parse_args(["--random", "qwen3-8b", "--profile", "--temperature", "1", "--steps", "64"])
    assert (args.profile, args.temperature, args.steps) == (True, 1.0, 64)


@pytest.mark.parametrize("flag", ["--prompt-len", "--steps", "--repeats"])
def test_counts_below_one_are_refused(flag, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--random", "qwen3-0.6b", flag, "0"])
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
