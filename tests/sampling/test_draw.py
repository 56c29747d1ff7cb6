"""The plain temperature draw and greedy rows, seeded rows independent of the batch around
them, and the Triton draw against the torch one under the Triton interpreter (one subprocess: this
file run as a script, TRITON_INTERPRET=1 being needed before triton is imported).
"""

import importlib.util
import json
from dataclasses import replace

import pytest
import torch
from sampling_helpers import NUM_DRAWS, check_draws, reference, sample_seqs, seed_tensor, seq_with
from triton_interpreter import results_under_interpreter, run_cases, squeeze_interpreter_loop_bounds

from nanovllm.engine.step import draw_seed
from nanovllm.sampling import torch_ops
from nanovllm.sampling_params import SamplingParams

TIE_GAP = 1e-5  # Triton vs torch: two tokens' Gumbel scores this close are a rounding near-tie


# ---- the plain temperature draw ------------------------------------------------------------------


def test_gumbel_argmax_distribution(model_logits):
    """Rows at T = 1, 0.7, 1.5 and 0 (greedy), and one with its three most likely tokens masked to
    -inf; the seeds are a seeded request's per-step draw seeds."""
    masked = model_logits[0].clone()
    masked[masked.topk(3).indices] = float("-inf")
    rows = torch.stack([model_logits[0], model_logits[1], model_logits[2], model_logits[3], masked])
    temps = torch.tensor([1.0, 0.7, 1.5, 0.0, 1.0])
    width = len(temps)
    seeds = torch.tensor([draw_seed(1234, step) for step in range(NUM_DRAWS * width)])
    tokens = torch_ops.gumbel_argmax(rows.repeat(NUM_DRAWS, 1), temps.repeat(NUM_DRAWS), seeds)
    for j in range(width):
        drawn = tokens[j::width]
        what = f"gumbel_argmax row {j}, T={temps[j].item()}"
        if temps[j] == 0:
            assert (drawn == rows[j].argmax()).all(), f"{what}: {drawn.unique().tolist()}"
        else:
            expected = reference(rows[j], float(temps[j]))
            assert len(expected.allowed) == expected.support
            check_draws(drawn, expected, what)


def test_gumbel_argmax_greedy_rows_are_argmax():
    """T = 0 rows take the first maximum, whatever their seed, beside rows that sample."""
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(64, 3000, generator=g).round(decimals=1)  # many equal values
    logits[4, [17, 2500]] = 100.0  # equal maxima: the lower id
    temps = torch.tensor([0.0, 1.0] * 32)
    tokens = torch_ops.gumbel_argmax(logits, temps, seed_tensor(64, 11))
    greedy = torch.arange(0, 64, 2)
    want = torch.tensor([int(torch.nonzero(r == r.max())[0]) for r in logits[greedy]])
    assert torch.equal(tokens[greedy], want), (tokens[greedy].tolist(), want.tolist())
    assert tokens[4] == 17


@pytest.mark.parametrize("temperature", [1e-39, 1e-38])
def test_tiny_temperature_draws_the_argmax(temperature):
    """SamplingParams accepts any finite temperature > 0, and softmax(logits / T) at such a T
    (float64) puts all its mass on the argmax: every draw must be the argmax (or the temperature
    refused), also when logits / T overflows float32 (the second row's positive logits reach
    3.5e39)."""
    try:
        SamplingParams(temperature=temperature)
    except ValueError:
        return  # refusing such a temperature is right too
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0], [20.0, 35.0, -5.0, 34.0]])
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    assert (probs.max(dim=-1).values == 1.0).all(), probs
    want = logits.argmax(dim=-1).tolist()
    for seed in range(20):
        seqs = [seq_with(SamplingParams(temperature=temperature, seed=seed)) for _ in range(2)]
        got = sample_seqs(seqs, logits).token_ids.tolist()
        assert got == want, (
            f"T={temperature}, seed {seed}: drew {got}, the argmax is {want} (probability 1)"
        )


# ---- seeds ---------------------------------------------------------------------------------------

VOCAB = 2000


SEEDED_TARGETS = {
    "plain": SamplingParams(temperature=0.9),
    "top_p": SamplingParams(temperature=1.1, top_p=0.8),
    "all_three": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02),
}
# batch neighbours: greedy, unseeded, a top-k past NUM_CANDIDATES, min-p, another seed
OTHER_ROWS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.0, top_k=700),
    SamplingParams(temperature=0.5, min_p=0.3, seed=99),
    SamplingParams(temperature=1.0, top_p=0.95, seed=3),
]


NUM_SEEDS = 60


@pytest.mark.parametrize("target", list(SEEDED_TARGETS))
def test_seeded_row_independent_of_batch(target):
    """NUM_SEEDS seeded copies of one row (their seeds and steps differ), each drawn alone, then all
    in one batch, then scattered in random order among twice as many other rows (other logits, other
    settings): each copy draws the same token every time."""
    g = torch.Generator().manual_seed(12)
    target_logits = 2.0 * torch.randn(VOCAB, generator=g)
    others = 2.0 * torch.randn(len(OTHER_ROWS), VOCAB, generator=g)
    copies = [
        seq_with(replace(SEEDED_TARGETS[target], seed=s * 7919), s % 4) for s in range(NUM_SEEDS)
    ]
    alone = [int(sample_seqs([seq], target_logits.unsqueeze(0)).token_ids[0]) for seq in copies]
    assert len(set(alone)) > 10, f"{target}: the draws hardly vary with the seed: {alone}"
    together = sample_seqs(copies, target_logits.repeat(NUM_SEEDS, 1)).token_ids.tolist()
    assert together == alone, f"{target}: all copies in one batch draw {together}, alone {alone}"

    entries = [(seq, target_logits) for seq in copies]
    for j in range(2 * NUM_SEEDS):
        entries.append((seq_with(OTHER_ROWS[j % len(OTHER_ROWS)], 3), others[j % len(OTHER_ROWS)]))
    order = torch.randperm(len(entries), generator=g).tolist()
    out = sample_seqs(
        [entries[i][0] for i in order], torch.stack([entries[i][1] for i in order])
    ).token_ids
    scattered = [int(out[order.index(k)]) for k in range(NUM_SEEDS)]
    assert scattered == alone, (
        f"{target}: copies scattered among other rows draw {scattered}, alone {alone}; "
        "differing copies "
        f"{[k for k in range(NUM_SEEDS) if scattered[k] != alone[k]]}"
    )


def test_draw_seed_range_and_spread():
    values = {draw_seed(seed, step) for seed in range(100) for step in range(100)}
    assert all(0 <= v < 1 << 32 for v in values)
    assert len(values) == 100 * 100, "two (seed, step) pairs share a draw seed"
    assert draw_seed(5, 0) == draw_seed(5, 0) and draw_seed(-3, 2) >= 0


# ---- the Triton draw under the interpreter -------------------------------------------------------


def triton_case(
    vocab: int,
    dtype: torch.dtype,
    seed: int,
    rows_per_temperature: int = 6,
    stride_pad: int = 0,
    ties: bool = False,
    shift: float = 0.0,
    chunk_blocks: int | None = None,
) -> dict:
    """``triton_draw.gumbel_argmax`` against ``torch_ops.gumbel_argmax`` on the same inputs (logits
    around ``shift``); a differing token is a near-tie when the two tokens' Gumbel scores are within
    TIE_GAP. ``chunk_blocks``: programs of that many BLOCKs each (default: the kernel's CHUNK), so
    that a small vocabulary spans several programs."""
    from nanovllm.sampling import triton_draw

    g = torch.Generator().manual_seed(seed)
    temps = torch.tensor([0.0, 0.3, 1.0, 2.5]).repeat_interleave(rows_per_temperature)
    n = temps.numel()
    wide = (shift + 1.5 * torch.randn(n, vocab + stride_pad, generator=g)).to(dtype)
    if ties:  # equal maxima in other blocks and in the same lane of another block; masked tokens
        wide[:, :vocab:97] = float("-inf")
        wide[:, [5, 5 + triton_draw.BLOCK, vocab - 1]] = 30.0
    logits = wide[:, :vocab]
    seeds = seed_tensor(n, seed)
    chunk = triton_draw.BLOCK * chunk_blocks if chunk_blocks else triton_draw.CHUNK
    got = triton_draw.gumbel_argmax(logits, temps, seeds, chunk=chunk)
    want = torch_ops.gumbel_argmax(logits, temps, seeds)
    mismatches, near_ties = [], 0
    for i in torch.nonzero(got != want).flatten().tolist():
        a, b = int(got[i]), int(want[i])
        t = float(temps[i])
        if not 0 <= a < vocab:
            mismatches.append(dict(row=i, temperature=t, triton=a, torch=b, score_gap=None))
            continue
        ids = torch.tensor([a, b])
        scores = logits[i, ids].float()
        if t > 0:
            scores = scores / t + torch_ops.gumbel(seeds[i : i + 1], ids)[0]
        gap = float((scores[0] - scores[1]).abs())
        if t > 0 and gap <= TIE_GAP:
            near_ties += 1
        else:
            mismatches.append(dict(row=i, temperature=t, triton=a, torch=b, score_gap=gap))
    return dict(
        rows=n, near_ties=near_ties, mismatches=mismatches, distinct=len(set(want.tolist()))
    )


def triton_skip_case(chunk_blocks: int | None = None) -> dict:
    """Rows with a negative temperature are skipped: their ``out`` entries keep what was there; the
    others get the torch draw's tokens."""
    from nanovllm.sampling import triton_draw

    g = torch.Generator().manual_seed(30)
    logits = torch.randn(6, 3000, generator=g) * 2
    temps = torch.tensor([0.7, -1.0, 0.0, -1.0, 1.3, -0.5])
    seeds = seed_tensor(6, 30)
    out = torch.full((6,), -7, dtype=torch.int64)
    chunk = triton_draw.BLOCK * chunk_blocks if chunk_blocks else triton_draw.CHUNK
    got = triton_draw.gumbel_argmax(logits, temps, seeds, out=out, chunk=chunk)
    drawn = [0, 2, 4]
    want = torch_ops.gumbel_argmax(logits[drawn], temps[drawn], seeds[drawn])
    return dict(returned_out=got is out, out=out.tolist(), want=want.tolist())


def triton_sharded_case(
    vocab: int, shards: int, seed: int, chunk_blocks: int | None = None
) -> dict:
    """Tensor parallelism's draw: each share of the vocabulary's chunk winners (``gumbel_parts``
    with its first id), stacked in rank order, then ``best_of_parts``, against ``gumbel_argmax``
    over the whole row. Equal maxima sit in different shares, and some rows are skipped."""
    from nanovllm.sampling import triton_draw

    g = torch.Generator().manual_seed(seed)
    temps = torch.tensor([0.0, 0.3, 1.0, 2.5, -1.0]).repeat_interleave(4)
    n, share = temps.numel(), vocab // shards
    logits = (1.5 * torch.randn(n, vocab, generator=g)).to(torch.bfloat16)
    logits[:4, [3, share + 3, vocab - 1]] = 30.0  # greedy rows: the lowest id of equal maxima wins
    seeds = seed_tensor(n, seed)
    chunk = triton_draw.BLOCK * chunk_blocks if chunk_blocks else triton_draw.CHUNK
    parts = torch.stack(
        [
            triton_draw.gumbel_parts(
                logits[:, r * share : (r + 1) * share], temps, seeds, r * share, chunk
            )
            for r in range(shards)
        ]
    )
    got = triton_draw.best_of_parts(parts, temps, vocab, torch.full((n,), -7, dtype=torch.int64))
    want = triton_draw.gumbel_argmax(
        logits, temps, seeds, out=torch.full((n,), -7, dtype=torch.int64), chunk=chunk
    )
    return dict(got=got.tolist(), want=want.tolist(), distinct=len(set(want.tolist())))


TRITON_SHARDED_CASES = {
    "sharded_two_ranks": lambda: triton_sharded_case(5000, 2, 40),
    "sharded_two_ranks_chunks_of_one_block": lambda: triton_sharded_case(
        10000, 2, 41, chunk_blocks=1
    ),
    "sharded_four_ranks_chunks_of_one_block": lambda: triton_sharded_case(
        9000, 4, 42, chunk_blocks=1
    ),
}

TRITON_CASES = {
    "skipped_rows": triton_skip_case,
    "skipped_rows_two_chunks": lambda: triton_skip_case(chunk_blocks=1),
    "float32_vocab2000": lambda: triton_case(2000, torch.float32, 20),
    "bfloat16_vocab2000": lambda: triton_case(2000, torch.bfloat16, 21),
    "float32_vocab5000": lambda: triton_case(5000, torch.float32, 22),
    "bfloat16_vocab5000_strided": lambda: triton_case(5000, torch.bfloat16, 23, stride_pad=13),
    "float32_vocab4096_ties": lambda: triton_case(4096, torch.float32, 24, ties=True),
    "bfloat16_vocab4100_ties": lambda: triton_case(4100, torch.bfloat16, 25, ties=True),
    "float32_vocab3000_all_negative": lambda: triton_case(3000, torch.float32, 27, shift=-60.0),
    "float32_qwen3_vocab": lambda: triton_case(151936, torch.float32, 26, rows_per_temperature=1),
    # a row over several programs: ties across chunks (5 and 5 + BLOCK) and a short last chunk
    "float32_vocab4100_ties_chunks_of_one_block": lambda: triton_case(
        4100, torch.float32, 28, ties=True, chunk_blocks=1
    ),
    "bfloat16_vocab5000_strided_chunks_of_two_blocks": lambda: triton_case(
        5000, torch.bfloat16, 29, stride_pad=13, chunk_blocks=2
    ),
    "float32_vocab3000_all_negative_chunks": lambda: triton_case(
        3000, torch.float32, 31, shift=-60.0, chunk_blocks=1
    ),
}


def run_triton_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    return run_cases(TRITON_CASES | TRITON_SHARDED_CASES)


@pytest.fixture(scope="module")
def triton_results() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", ["skipped_rows", "skipped_rows_two_chunks"])
def test_triton_gumbel_argmax_skips_negative_temperatures(triton_results, case):
    """What a CUDA graph relies on: padding rows and rows the full sampler draws are left alone."""
    r = triton_results[case]
    assert "error" not in r, r
    assert r["returned_out"]
    assert [r["out"][i] for i in (1, 3, 5)] == [-7, -7, -7]
    assert [r["out"][i] for i in (0, 2, 4)] == r["want"]


@pytest.mark.parametrize("case", [c for c in TRITON_CASES if not c.startswith("skipped_rows")])
def test_triton_gumbel_argmax_matches_torch(triton_results, case):
    """The same token as the torch draw on every row; a sampled row may differ only at a near-tie
    (Gumbel scores within TIE_GAP), a greedy row never."""
    result = triton_results[case]
    assert "error" not in result, result["error"]
    assert not result["mismatches"], (
        f"{case}: Triton and torch draw different tokens: {result['mismatches']}"
    )
    assert result["distinct"] >= 3, f"{case}: the rows hardly differ: {result}"


@pytest.mark.parametrize("case", list(TRITON_SHARDED_CASES))
def test_triton_sharded_draw_equals_the_whole_row(triton_results, case):
    """Every rank's share drawn on its own and the winners combined: the very tokens of the draw
    over the whole vocabulary (the same score per id), skipped rows left alone."""
    r = triton_results[case]
    assert "error" not in r, r
    assert r["got"] == r["want"]
    assert r["want"][:4] == [3] * 4 and r["want"][-4:] == [-7] * 4
    assert r["distinct"] >= 8, r


if __name__ == "__main__":
    print(json.dumps(run_triton_cases()))
