"""The plain temperature draw on the CPU (``draw.cdf_draw``): the token the row's seeded uniform
selects from the exact cumulative distribution, so draws follow softmax(logits / T); greedy rows
take the argmax; a row draws the same token alone, in any batch and in any group of rows; the
sampler's CPU path is this draw."""

import pytest
import torch
from sampling_helpers import NUM_DRAWS, check_draws, reference, sample_seqs, seed_tensor, seq_with

from nanovllm.engine.step import draw_seed
from nanovllm.sampling import draw as cpu_draw
from nanovllm.sampling_params import SamplingParams


def draws_of(row: torch.Tensor, temperature: float, seeds: torch.Tensor) -> torch.Tensor:
    n = seeds.numel()
    return cpu_draw.cdf_draw(row.unsqueeze(0).repeat(n, 1), torch.full((n,), temperature), seeds)


def rows_with_a_tail_block() -> torch.Tensor:
    """Rows of 1000 tokens (7 full blocks of 128 and a short one): spread logits, a few dominant
    tokens in the last block, masked tokens, and equal logits."""
    g = torch.Generator().manual_seed(3)
    spread = 3.0 * torch.randn(1000, generator=g)
    tail_heavy = torch.randn(1000, generator=g)
    tail_heavy[[990, 997, 999]] = 6.0
    masked = torch.randn(1000, generator=g).round(decimals=1)
    masked[::3] = float("-inf")
    return torch.stack([spread, tail_heavy, masked])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_distribution_of_model_rows(model_logits, temperature):
    """The tiny checkpoint's next-token rows (vocab 512), one with its three most likely tokens
    masked: chi-square against softmax(logits / T) in float64, seeds of a seeded request's steps."""
    masked = model_logits[0].clone()
    masked[masked.topk(3).indices] = float("-inf")
    seeds = torch.tensor([draw_seed(4321, step) for step in range(NUM_DRAWS)])
    for j, row in enumerate([*model_logits, masked]):
        check_draws(
            draws_of(row, temperature, seeds),
            reference(row, temperature),
            f"row {j}, T={temperature}",
        )


@pytest.mark.parametrize("temperature", [1.0, 0.4])
def test_distribution_with_a_short_last_block(temperature):
    seeds = seed_tensor(NUM_DRAWS, 8)
    for j, row in enumerate(rows_with_a_tail_block()):
        expected = reference(row, temperature)
        drawn = draws_of(row, temperature, seeds)
        assert torch.isfinite(row[drawn]).all(), f"row {j}: drew a masked token"
        check_draws(drawn, expected, f"row {j} of 1000 tokens, T={temperature}")


def test_the_token_is_where_the_uniform_falls_in_the_cumulative_distribution():
    """For every seed, the token is the first whose cumulative probability (float64, from the
    logits) exceeds u = row_uniform_bits(seed) / 2**64; seeds whose u is within 1e-9 of a boundary
    are skipped."""
    g = torch.Generator().manual_seed(5)
    for vocab, temperature in [(3, 1.0), (300, 0.8), (1000, 2.0)]:
        row = 2.0 * torch.randn(vocab, generator=g)
        cdf = torch.softmax(row.double() / temperature, dim=0).cumsum(0)
        seeds = seed_tensor(3000, vocab)
        drawn = draws_of(row, temperature, seeds)
        checked = 0
        for seed, token in zip(seeds.tolist(), drawn.tolist()):
            u = cpu_draw.row_uniform_bits(seed) / 2.0**64
            if (cdf - u).abs().min() < 1e-9:
                continue
            want = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True))
            assert token == want, (
                f"vocab {vocab}, seed {seed}: u={u} falls on token {want}, drew {token}"
            )
            checked += 1
        assert checked > 2900


def test_greedy_rows_take_the_first_maximum_beside_drawn_rows():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(16, 3000, generator=g).round(decimals=1)  # many equal values
    logits[4, [17, 2500]] = 100.0  # equal maxima: the lower id
    temps = torch.tensor([0.0, 1.0] * 8)
    tokens = cpu_draw.cdf_draw(logits, temps, seed_tensor(16, 11))
    greedy = torch.arange(0, 16, 2)
    assert torch.equal(tokens[greedy], logits[greedy].argmax(dim=-1))
    assert tokens[4] == 17
    assert (tokens[1::2] != logits[1::2].argmax(dim=-1)).any(), "the drawn rows all took the argmax"


def test_a_row_with_one_finite_token_always_draws_it():
    row = torch.full((700,), float("-inf"))
    row[650] = -3.0  # in the short last block
    assert (draws_of(row, 1.3, seed_tensor(200, 2)) == 650).all()


def test_a_row_draws_the_same_token_alone_and_in_any_batch():
    """Rows of 2**17 + 3 tokens: ``cdf_draw`` works on 4 rows at a time, so a batch of 11 (two of
    them greedy) splits the drawn rows into groups differently from each row alone or in a
    permuted order; every row must draw the same token in each."""
    vocab = 2**17 + 3
    assert cpu_draw.CDF_GROUP // vocab == 3
    g = torch.Generator().manual_seed(21)
    logits = 0.5 * torch.randn(11, vocab, generator=g)
    temps = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9, 1.0, 0.0, 0.5, 2.0, 1.0, 0.8])
    seeds = seed_tensor(11, 21)
    batch = cpu_draw.cdf_draw(logits, temps, seeds)
    alone = torch.cat(
        [
            cpu_draw.cdf_draw(logits[i : i + 1], temps[i : i + 1], seeds[i : i + 1])
            for i in range(11)
        ]
    )
    assert torch.equal(batch, alone), (batch.tolist(), alone.tolist())
    order = torch.randperm(11, generator=g)
    permuted = cpu_draw.cdf_draw(logits[order], temps[order], seeds[order])
    assert torch.equal(permuted, batch[order])
    assert len(set(batch.tolist())) > 5


def test_the_cpu_sampler_draws_plain_rows_with_the_cdf_draw():
    """A plain seeded batch through the engine's Sampler on the CPU: the tokens of ``cdf_draw`` with
    the rows' draw seeds (not the Gumbel-max reference of the GPU kernel)."""
    g = torch.Generator().manual_seed(30)
    logits = torch.randn(6, 2000, generator=g)
    seqs = [seq_with(SamplingParams(temperature=0.9, seed=100 + i), i) for i in range(6)]
    seeds = torch.tensor([draw_seed(100 + i, i) for i in range(6)])
    want = cpu_draw.cdf_draw(logits, torch.full((6,), 0.9), seeds)
    assert torch.equal(sample_seqs(seqs, logits).token_ids, want)
