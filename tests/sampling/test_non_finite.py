"""Logits that are not a finite distribution (NaN weights, a repetition penalty that overflows):
every draw returns an id inside the vocabulary. NaN counts as -inf; a row with a +inf logit draws
the lowest such id; a row with no finite or +inf logit draws token 0 (docs/sampling.md)."""

import pytest
import torch
from sampling_helpers import filtered_draws, sample_seqs, seed_tensor, seq_with

from nanovllm.sampling.draw import cdf_draw
from nanovllm.sampling_params import SamplingParams

VOCAB = 1000
INF, NAN = float("inf"), float("nan")


def rows() -> dict[str, torch.Tensor]:
    base = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    out = {}
    for name, where, value in [
        ("one NaN", [5], NAN),
        ("NaN last", [VOCAB - 1], NAN),
        ("many NaN", list(range(0, VOCAB, 3)), NAN),
        ("one +inf", [700], INF),
        ("two +inf", [998, 500], INF),
        ("+inf and NaN", [3, 400], [NAN, INF]),
    ]:
        row = base.clone()
        row[where] = torch.tensor(value)
        out[name] = row
    out["all -inf"] = torch.full((VOCAB,), -INF)
    out["all NaN"] = torch.full((VOCAB,), NAN)
    out["-inf and one NaN"] = torch.full((VOCAB,), -INF).index_fill_(0, torch.tensor([999]), NAN)
    return out


def want(row: torch.Tensor) -> int | None:
    """The token a row must draw, or None where it is a draw among its finite logits."""
    if (row == INF).any():
        return int((row == INF).nonzero()[0])
    if not torch.where(row.isnan(), -INF, row).isfinite().any():
        return 0
    return None


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_cdf_draw(temperature):
    """Ids in range; a NaN draws what -inf in its place draws (same seed); +inf and all -inf/NaN
    rows draw the token the rule names."""
    named = rows()
    x = torch.stack(list(named.values()))
    seeds = seed_tensor(len(named), 3)
    temperatures = torch.full((len(named),), temperature)
    got = cdf_draw(x, temperatures, seeds).tolist()
    as_inf = cdf_draw(torch.where(x.isnan(), -INF, x), temperatures, seeds).tolist()
    for (name, row), token, other in zip(named.items(), got, as_inf):
        assert 0 <= token < VOCAB, name
        assert token == (want(row) if want(row) is not None else other), name
        assert not row[token].isnan() or want(row) == 0, name


def test_cdf_draw_mixes_finite_and_non_finite_rows():
    """A finite row beside non-finite ones draws what it draws alone; greedy rows take argmax."""
    named = rows()
    finite = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    x = torch.cat([finite, torch.stack(list(named.values()))])
    seeds = seed_tensor(x.size(0), 4)
    temperatures = torch.ones(x.size(0))
    temperatures[1] = 0
    got = cdf_draw(x, temperatures, seeds)
    assert got[:2].tolist() == cdf_draw(finite, temperatures[:2], seeds[:2]).tolist()
    assert ((got >= 0) & (got < VOCAB)).all()


@pytest.mark.parametrize(
    "settings", [dict(top_p=0.9), dict(min_p=0.1), dict(top_k=20), dict(top_k=5, top_p=0.5)]
)
def test_filtered_draw_stays_in_the_vocabulary(settings):
    for name, row in rows().items():
        tokens = filtered_draws(row, seed_tensor(16, 5), 0.8, **settings)
        assert ((tokens >= 0) & (tokens < VOCAB)).all(), name


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(temperature=0.8, max_tokens=4),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4),
        SamplingParams(temperature=0.8, max_tokens=4, repetition_penalty=1e-40),
        SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1e-40, logprobs=2),
    ],
)
def test_the_samplers_paths_stay_in_the_vocabulary(params):
    """Greedy, plain, filtered, penalised: every row of non-finite logits gets an id in range."""
    named = rows()
    seqs = [seq_with(params, 2, prompt=[1, 2, 700]) for _ in named]
    tokens = sample_seqs(seqs, torch.stack(list(named.values()))).token_ids
    assert ((tokens >= 0) & (tokens < VOCAB)).all(), tokens.tolist()
