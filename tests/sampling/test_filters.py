"""Filtered draws (temperature, then min-p, top-k and top-p, in vLLM's order) against the float64
reference of ``sampling_helpers``: the set of tokens a draw may return and the distribution of
thousands of draws. Each setting is picked so that every filter removes tokens, and away from its
thresholds (a float32 rounding cannot move a token across). Also the Sampler on a batch of filtered,
plain and greedy rows."""

import pytest
import torch
from sampling_helpers import (
    NUM_DRAWS,
    Expected,
    check_draws,
    filtered_draws,
    reference,
    seed_tensor,
)

from nanovllm.sampling import torch_ops
from nanovllm.sampling.extras import NUM_CANDIDATES, Filters
from nanovllm.sampling.sampler import Sampler, SamplingBatch


def tie_row() -> torch.Tensor:
    """Vocabulary 600 (> NUM_CANDIDATES): 3 tokens at logit 4, 5 at 3, 10 at 2, scattered among
    582 distinct lower ones."""
    g = torch.Generator().manual_seed(5)
    row = -1.0 + 0.5 * torch.randn(600, generator=g)
    perm = torch.randperm(600, generator=g)
    row[perm[:3]], row[perm[3:8]], row[perm[8:18]] = 4.0, 3.0, 2.0
    return row


def flat_row(vocab: int = 2000) -> torch.Tensor:
    """Nearly flat, distinct logits: top-p or min-p keep far more than NUM_CANDIDATES tokens."""
    return 0.05 * torch.randn(vocab, generator=torch.Generator().manual_seed(6))


MODEL_SETTINGS = {
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.6),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "all_three": dict(temperature=0.8, min_p=0.01, top_k=25, top_p=0.6),
    "cold_top_p": dict(temperature=0.5, top_p=0.9),
    "hot_top_k_min_p": dict(temperature=1.7, top_k=12, min_p=0.1),
}


def assert_filters_bite(expected: Expected, what: str) -> None:
    """Each filter that is on removes tokens, so a wrong filter changes the allowed set."""
    assert expected.num_kept < expected.support, (
        f"{what}: the filters keep all {expected.support} tokens"
    )
    sizes = list(expected.stage_sizes.items())
    for (before_name, before), (name, after) in zip(sizes, sizes[1:]):
        assert after < before, (
            f"{what}: {name} keeps all {before} tokens left by {before_name}; pick a tighter one"
        )


@pytest.mark.parametrize("setting", list(MODEL_SETTINGS))
def test_filtered_draws_on_model_logits(model_logits, setting):
    """Each setting on two of the four rows (every filter bites on all four)."""
    params = MODEL_SETTINGS[setting]
    first = list(MODEL_SETTINGS).index(setting)
    for i, row in enumerate(model_logits):
        what = f"model row {i}, {params}"
        expected = reference(row, **params)
        assert_filters_bite(expected, what)
        if i in (first % 4, (first + 1) % 4):
            tokens = filtered_draws(row, seed_tensor(NUM_DRAWS, 100 * i + first), **params)
            check_draws(tokens, expected, what)


TIE_SETTINGS = {
    "top_k_inside_level": dict(temperature=1.0, top_k=5),  # all 3 at logit 4, 2 of the 5 at logit 3
    "top_p_inside_level": dict(temperature=1.0, top_p=0.35),
    "min_p_at_levels": dict(temperature=1.0, min_p=0.3),
    "hot_top_k_top_p": dict(temperature=2.0, top_k=12, top_p=0.5),
}


@pytest.mark.parametrize(
    "setting,beside_top_p",
    [(name, False) for name in TIE_SETTINGS]
    + [(name, True) for name, p in TIE_SETTINGS.items() if p.get("top_k")],
)
def test_filtered_draws_with_ties(setting, beside_top_p):
    """Top-k rows also as in a batch that holds a row without top-k (NUM_CANDIDATES candidates out
    of 600 tokens, and top-p normalises over what top-k kept, not over the vocabulary)."""
    params = TIE_SETTINGS[setting]
    row = tie_row()
    what = f"tie row, {params}" + (", beside a top-p row" if beside_top_p else "")
    expected = reference(row, **params)
    assert_filters_bite(expected, what)
    tokens = filtered_draws(
        row, seed_tensor(NUM_DRAWS, len(setting)), **params, beside_top_p=beside_top_p
    )
    check_draws(tokens, expected, what)


FLAT_SETTINGS = {
    "top_p": dict(temperature=1.0, top_p=0.5),
    "min_p": dict(temperature=1.0, min_p=0.8),
    "min_p_top_p": dict(temperature=0.7, min_p=0.7, top_p=0.8),
}


@pytest.mark.parametrize("setting", list(FLAT_SETTINGS))
def test_filtered_draws_past_the_candidates(setting):
    """A row without top-k that keeps more than NUM_CANDIDATES tokens is redone over the whole
    vocabulary: tokens ranked past NUM_CANDIDATES must be drawn, with the right frequency."""
    params = FLAT_SETTINGS[setting]
    row = flat_row()
    expected = reference(row, **params)
    what = f"flat row of {row.numel()}, {params}"
    assert_filters_bite(expected, what)
    assert expected.num_kept > NUM_CANDIDATES, f"{what}: keeps only {expected.num_kept} tokens"
    tokens = filtered_draws(row, seed_tensor(NUM_DRAWS, 7 + len(setting)), **params)
    rank = torch.argsort(torch.argsort(row, descending=True))
    past = int((rank[tokens] >= NUM_CANDIDATES).sum())
    assert past > 0, f"{what}: no draw ranked past the {NUM_CANDIDATES} candidates"
    check_draws(tokens, expected, what)


def test_filtered_draws_exactly_flat_row():
    """2000 equal logits, top_p 0.3002: 601 tokens are kept (the mass before the 601st is 0.3), so
    at most 601 distinct tokens may be drawn out of 4000 draws."""
    row = torch.zeros(2000)
    expected = reference(row, 1.0, top_p=0.3002)
    assert expected.num_kept == 601
    tokens = filtered_draws(row, seed_tensor(NUM_DRAWS, 8), 1.0, top_p=0.3002)
    check_draws(tokens, expected, "exactly flat row, top_p=0.3002")


# ---- the Sampler on a batch of filtered, plain and greedy rows -----------------------------------

MIXED_ROWS = [  # (model row, settings)
    (0, dict(temperature=0.8, top_k=25, top_p=0.6, min_p=0.01)),
    (1, dict(temperature=1.0)),
    (2, dict(temperature=0.0)),
    (3, dict(temperature=0.6, top_p=0.8)),
    (0, dict(temperature=1.3)),
    (1, dict(temperature=0.0)),
    (2, dict(temperature=1.2, top_k=8)),
]


def test_sampler_mixed_batch(model_logits):
    """One Sampler call over NUM_DRAWS copies of MIXED_ROWS, interleaved: filtered rows follow the
    reference, plain rows softmax(logits / T), greedy rows the argmax."""
    width = len(MIXED_ROWS)
    n = NUM_DRAWS * width
    logits = model_logits[[r for r, _ in MIXED_ROWS]].repeat(NUM_DRAWS, 1)
    temperatures = torch.tensor([s["temperature"] for _, s in MIXED_ROWS]).repeat(NUM_DRAWS)
    filtered = [j for j, (_, s) in enumerate(MIXED_ROWS) if len(s) > 1]
    rows = torch.tensor([k * width + j for k in range(NUM_DRAWS) for j in filtered])
    setting = [MIXED_ROWS[j][1] for j in filtered] * NUM_DRAWS
    filters = Filters(
        rows=rows,
        top_k=torch.tensor([s.get("top_k", 0) for s in setting]),
        top_p=torch.tensor([s.get("top_p", 1.0) for s in setting]),
        min_p=torch.tensor([s.get("min_p", 0.0) for s in setting]),
        num_candidates=NUM_CANDIDATES,
        all_top_k=False,
    )
    batch = SamplingBatch(temperatures, seed_tensor(n, 9), all_greedy=False, filters=filters)
    tokens = Sampler()(logits, batch).token_ids
    assert tokens.shape == (n,) and tokens.dtype == torch.int64
    for j, (r, params) in enumerate(MIXED_ROWS):
        drawn = tokens[j::width]
        what = f"mixed batch row {j} (model row {r}, {params})"
        if params["temperature"] == 0:
            assert (drawn == model_logits[r].argmax()).all(), f"{what}: {drawn.unique().tolist()}"
            continue
        expected = reference(model_logits[r], **params)
        if len(params) > 1:
            assert_filters_bite(expected, what)
        check_draws(drawn, expected, what)


@pytest.mark.parametrize(
    "settings", [dict(top_p=0.9), dict(top_p=0.5, min_p=0.01), dict(min_p=0.05), dict(top_p=0.999)]
)
@pytest.mark.parametrize("scale", [0.05, 0.5, 3.0])
def test_past_the_candidates_the_tokens_of_a_full_sort(settings, scale):
    """Rows whose kept set reaches past the candidates draw, seed for seed, what they draw with the
    whole vocabulary as candidates (on the CPU the second look takes only as many as needed)."""
    g = torch.Generator().manual_seed(7)
    rows, vocab = 64, 20000
    logits = torch.randn(rows, vocab, generator=g) * scale
    seeds = seed_tensor(rows, 8)

    def draw(num_candidates: int) -> list[int]:
        return torch_ops.sample_filtered(
            logits,
            torch.full((rows,), 0.8),
            seeds,
            torch.zeros(rows, dtype=torch.int64),
            torch.full((rows,), settings.get("top_p", 1.0)),
            torch.full((rows,), settings["min_p"]) if "min_p" in settings else None,
            num_candidates,
            False,
        ).tolist()

    assert draw(NUM_CANDIDATES) == draw(vocab)
