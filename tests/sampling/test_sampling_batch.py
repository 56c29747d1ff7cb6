"""``make_sampling_batch`` on real sequences (the engine's rows, EOS added to the min_tokens
ids), and the rows' ``plain`` flag: steps the fused draw serves by itself.
"""

import pytest
import torch
from sampling_helpers import make_batch, seq_with, step_rows

from nanovllm.engine.sequence import Sequence, request_sequences
from nanovllm.engine.step import draw_seed
from nanovllm.features.attach import attach_processors
from nanovllm.sampling.extras import NUM_CANDIDATES
from nanovllm.sampling_params import SamplingParams

# ---- make_sampling_batch -------------------------------------------------------------------------

EOS = 0


def request_seqs(
    prompt: list[int], params: SamplingParams, completion: list[int]
) -> list[Sequence]:
    """The sequences of one request, EOS added to the min_tokens ids as the engine does, with
    ``completion`` generated already."""
    seqs = request_sequences(0, prompt, params, block_size=16)
    attach_processors(seqs, [EOS])
    for seq in seqs:
        for t in completion:
            seq.append_placeholder(-1)
            seq.set_token(len(seq) - 1, t)
    return seqs


def pairs(t: tuple[torch.Tensor, torch.Tensor] | None) -> list[tuple[int, int]]:
    """(row, token id) pairs as a sorted list."""
    return sorted(zip(t[0].tolist(), t[1].tolist())) if t is not None else []


def test_make_sampling_batch_mixed():
    """Six sequences of five requests (one with n=2), each row using a different part of the
    batch."""
    vocab = 1000
    seqs = [
        # 0: seeded, top-p (top_k -1 = off), below min_tokens: suppresses 7 and EOS, not 5000
        # (past the vocabulary)
        *request_seqs(
            [1, 2, 3, 2],
            SamplingParams(
                temperature=0.7,
                top_k=-1,
                top_p=0.9,
                seed=5,
                min_tokens=3,
                stop_token_ids=[7, 5000],
                logprobs=2,
            ),
            [4],
        ),
        # 1: greedy with a repetition penalty, min_tokens reached: nothing suppressed; top_k
        # ignored (greedy)
        *request_seqs(
            [8, 8],
            SamplingParams(temperature=0.0, repetition_penalty=1.2, min_tokens=1, top_k=3),
            [5],
        ),
        # 2: plain, presence and frequency penalties
        *request_seqs(
            [9],
            SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3),
            [6, 6, 1],
        ),
        # 3, 4: n=2, seeds 10 and 11; top-k and min-p; ignore_eos: nothing suppressed
        *request_seqs(
            [3],
            SamplingParams(
                temperature=1.2,
                top_k=40,
                min_p=0.1,
                seed=10,
                n=2,
                min_tokens=5,
                ignore_eos=True,
                logprobs=5,
            ),
            [2, 2],
        ),
        # 5: seeded plain, min_tokens without stop ids: EOS suppressed
        *request_seqs(
            [4, 4, 4], SamplingParams(temperature=0.5, seed=123, logprobs=0, min_tokens=1), []
        ),
    ]
    batch = make_batch(seqs, vocab)
    assert batch.temperatures.dtype == torch.float32
    assert batch.temperatures.tolist() == pytest.approx([0.7, 0.0, 1.0, 1.2, 1.2, 0.5])
    assert batch.all_greedy is False
    assert batch.seeds.dtype == torch.int64 and batch.seeds.shape == (6,)
    assert ((batch.seeds >= 0) & (batch.seeds < 1 << 32)).all(), batch.seeds
    seeded = {0: draw_seed(5, 1), 3: draw_seed(10, 2), 4: draw_seed(11, 2), 5: draw_seed(123, 0)}
    assert {i: int(batch.seeds[i]) for i in seeded} == seeded

    assert pairs(batch.suppress) == [(0, EOS), (0, 7), (5, EOS)]

    p = batch.penalties
    assert p.rows.tolist() == [1, 2]
    assert p.repetition.tolist() == pytest.approx([1.2, 1.0])
    assert p.presence.tolist() == pytest.approx([0.0, 0.5])
    assert p.frequency.tolist() == pytest.approx([0.0, 0.3])
    assert pairs(p.prompt_tokens) == [(0, 8), (0, 8), (1, 9)]
    assert pairs(p.output_tokens) == [(0, 5), (1, 1), (1, 6), (1, 6)]

    f = batch.filters
    assert f.rows.tolist() == [0, 3, 4]
    assert f.top_k.tolist() == [0, 40, 40]
    assert f.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    assert f.min_p.tolist() == pytest.approx([0.0, 0.1, 0.1])
    assert f.num_candidates == NUM_CANDIDATES and f.all_top_k is False

    assert batch.logprob_rows.tolist() == [0, 3, 4, 5]
    assert batch.num_logprobs == 5


def test_make_sampling_batch_all_greedy():
    """Greedy rows need no seeds and no filters, whatever else their settings say."""
    seqs = [seq_with(SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3)) for _ in range(3)]
    batch = make_batch(seqs, 100)
    assert batch.all_greedy is True and batch.seeds is None
    assert batch.filters is None and batch.penalties is None and batch.suppress is None
    assert batch.logprob_rows is None
    assert batch.temperatures.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "top_ks,vocab,num_candidates,all_top_k",
    [
        ([5, 40], 1000, 40, True),  # every row has top-k: the largest is enough
        ([5, 0], 1000, NUM_CANDIDATES, False),  # a top-p row: NUM_CANDIDATES
        ([700, 0], 1000, 700, False),  # a top-k past NUM_CANDIDATES
        ([50, 0], 300, 300, False),  # never more than the vocabulary
        ([5000, 3], 30, 30, True),  # top_k clipped to the vocabulary
    ],
)
def test_make_sampling_batch_candidates(top_ks, vocab, num_candidates, all_top_k):
    """Enough candidates for every top-k, never more than the vocabulary."""
    seqs = [
        seq_with(SamplingParams(temperature=1.0, top_k=k, top_p=0.9 if k == 0 else 1.0))
        for k in top_ks
    ]
    f = make_batch(seqs, vocab).filters
    assert f.top_k.tolist() == [min(k, vocab) for k in top_ks]
    assert (f.num_candidates, f.all_top_k) == (num_candidates, all_top_k)
    assert f.min_p is None
    assert f.num_candidates >= max(f.top_k.tolist())


# ---- plain rows: what the fused draw serves by itself --------------------------------------------


def plain_sampling(seqs: list[Sequence]):
    """(temperatures, seeds) of a plain step, or None when a row needs more of the sampler."""
    rows = step_rows(seqs)
    return (rows.temperatures, rows.seeds) if rows.plain else None


def test_plain_sampling_temperatures_and_seeds():
    """Greedy rows get temperature 0; a seeded row the draw seed of its token's index; unseeded
    rows a seed from the generator in [0, 2**32)."""
    seqs = [
        *request_seqs([1, 2], SamplingParams(temperature=0.0), [3]),
        *request_seqs([4], SamplingParams(temperature=0.8, seed=9), [5, 6]),
        *request_seqs([7], SamplingParams(temperature=1.5), []),
        *request_seqs([2], SamplingParams(temperature=0.6, seed=4, n=2), [8]),
    ]
    temperatures, seeds = plain_sampling(seqs)
    assert temperatures == pytest.approx([0.0, 0.8, 1.5, 0.6, 0.6])
    assert (
        seeds[1] == draw_seed(9, 2) and seeds[3] == draw_seed(4, 1) and seeds[4] == draw_seed(5, 1)
    )
    assert all(isinstance(s, int) and 0 <= s < 1 << 32 for s in seeds)
    batch = make_batch(seqs, 1000)
    assert batch.seeds[[1, 3, 4]].tolist() == [seeds[1], seeds[3], seeds[4]]
    assert batch.temperatures.tolist() == pytest.approx(temperatures)
    assert batch.filters is None and batch.penalties is None and batch.suppress is None


@pytest.mark.parametrize(
    "params, completion",
    [
        (SamplingParams(temperature=0.7, top_p=0.9), []),
        (SamplingParams(temperature=0.7, top_k=5), []),
        (SamplingParams(temperature=0.7, min_p=0.1), []),
        (SamplingParams(temperature=0.0, repetition_penalty=1.1), []),
        (SamplingParams(temperature=0.7, presence_penalty=0.2), []),
        (SamplingParams(temperature=0.7, logprobs=0), []),
        (SamplingParams(temperature=0.7, min_tokens=2), [5]),
    ],
)
def test_plain_sampling_refuses_any_other_setting(params, completion):
    """One row that needs more than a temperature and a seed sends the whole batch to the
    sampler."""
    seqs = request_seqs([1], SamplingParams(temperature=0.5), []) + request_seqs(
        [2, 3], params, completion
    )
    assert plain_sampling(seqs) is None
    assert plain_sampling(seqs[:1]) is not None


def test_plain_sampling_after_min_tokens():
    """min_tokens only matters until it is reached."""
    seqs = request_seqs([1], SamplingParams(temperature=0.7, min_tokens=2), [5, 6])
    assert plain_sampling(seqs) is not None
