"""``Sequence`` (its blocks and derived fields), the step description built from sequences,
``SamplingParams`` validation, and the engine core importing without torch, transformers or triton.
"""

import pickle
import subprocess
import sys
from pathlib import Path
from random import Random

import pytest
from core_helpers import append_token, make_seq

from nanovllm.engine.step import build_step
from nanovllm.features.attach import attach_processors
from nanovllm.sampling_params import SamplingParams

# ---- Sequence ----------------------------------------------------------------------------------


def test_sequence_blocks_and_derived_fields():
    seq = make_seq(list(range(10)), block_size=4)
    assert seq.num_blocks == 3 and len(seq.block(2)) == 2
    assert seq.block(0) == [0, 1, 2, 3] and seq.block(2) == [8, 9]
    with pytest.raises(IndexError):
        seq.block(3)
    append_token(seq, 10)
    append_token(seq, 11)
    assert seq.num_blocks == 3 and len(seq.block(2)) == 4
    assert seq.prompt_token_ids == list(range(10)) and seq.completion_token_ids == [10, 11]
    assert make_seq([1, 2, 3]).seq_id < make_seq([1, 2, 3]).seq_id


def test_step_describes_only_what_it_computes():
    """What the workers get: plain lists of what the step computes (a chunk's tokens, a decode
    step's one token or its placeholder's row), never the sequences; of the sampling rows only a
    plain step's temperatures and draw seeds (every rank draws in a decode graph)."""
    seq = make_seq(list(range(10)), block_size=4)
    seq.block_table = [3, 1, 2]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 4, 5  # a chunk: tokens 4..8
    other = make_seq([7, 8], block_size=4)
    other.block_table, other.num_scheduled_tokens = [5], 2
    step = build_step([seq, other], True, Random(0))
    assert (step.token_ids, step.num_computed, step.num_new) == (
        [4, 5, 6, 7, 8, 7, 8],
        [4, 0],
        [5, 2],
    )
    assert step.block_tables == [[3, 1, 2], [5]] and step.prev_rows is None
    seq.num_cached_tokens, seq.num_scheduled_tokens = 10, 1
    append_token(seq, 42)
    other.num_cached_tokens, other.num_scheduled_tokens = 2, 1
    other.append_placeholder(row=1)  # sampled by the step in flight, in its row 1
    decode = build_step([seq, other], False, Random(0))
    assert (decode.token_ids, decode.num_computed, decode.num_new) == ([42, -1], [10, 2], [1, 1])
    assert decode.prev_rows == [-1, 1]
    sent = pickle.loads(pickle.dumps(decode.for_workers()))
    assert sent.token_ids == [42, -1] and sent.block_tables == [[3, 1, 2], [5]]
    assert decode.sampling.temperatures == [0.0, 0.0] and decode.sampling.plain
    rows = sent.sampling
    assert (rows.temperatures, rows.seeds, rows.extra, rows.plain) == (
        [0.0, 0.0],
        decode.sampling.seeds,
        None,
        True,
    )
    seq.sampling_params = SamplingParams(temperature=0.5, logprobs=2)  # its rows stay on rank 0
    attach_processors([seq], [])
    step = build_step([seq, other], False, Random(0))
    assert not step.sampling.plain and step.for_workers().sampling is None


def test_engine_core_does_not_import_torch():
    code = (
        "import sys\n"
        "import nanovllm.engine.scheduler, nanovllm.engine.block_manager, "
        "nanovllm.engine.sequence\n"
        "import nanovllm.sampling_params\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'triton', 'flash_attn'))\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    root = Path(__file__).resolve().parents[2]  # the repository root
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root
    )
    assert result.returncode == 0, f"engine core imported {result.stdout.strip()} {result.stderr}"


# ---- SamplingParams ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": float("inf")}, ValueError, "temperature"),
        ({"temperature": "0.7"}, TypeError, "temperature"),
        ({"temperature": None}, TypeError, "temperature"),
        ({"temperature": True}, TypeError, "temperature"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"max_tokens": -3}, ValueError, "max_tokens"),
        ({"max_tokens": 16.0}, TypeError, "max_tokens"),
        ({"max_tokens": True}, TypeError, "max_tokens"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos"),
        ({"ignore_eos": "yes"}, TypeError, "ignore_eos"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_good_values():
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    assert (p.temperature, p.max_tokens, p.ignore_eos) == (0.0, 1, True)
    assert isinstance(p.temperature, float)
