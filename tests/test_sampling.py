"""The sampling math against references computed here, independently, from the logits.

The filters (temperature, then min-p, top-k and top-p, in vLLM's order) are checked by the set of
tokens a draw may return and by the distribution of thousands of draws (a chi-square test at
p = 1e-3 over a fixed sequence of seeds, so a run is deterministic): a reference in float64 sorts the
probabilities and applies each filter in turn. Tokens with equal logits form one level: which of
them a cut inside the level keeps is arbitrary, but how many it keeps is not, so the reference checks
the number of distinct tokens drawn per level and the level's share of the draws. Each setting is
picked so that every filter removes tokens, and away from its thresholds (a float32 rounding cannot
move a token across). Also: plain temperature draws and greedy rows, seeded rows independent of the
batch around them, penalties against a per-row Python loop, log-probabilities against float64
log_softmax, the Triton draw against the torch one under the Triton interpreter (one subprocess: this
file run as a script, TRITON_INTERPRET=1 being needed before triton is imported), and
``make_sampling_batch`` on real sequences.
"""
import importlib.util
import json
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from hf_reference import random_prompts
from triton_interpreter import results_under_interpreter, run_cases, squeeze_interpreter_loop_bounds
from nanovllm.engine.requests import Request
from nanovllm.engine.sampling_batch import NUM_CANDIDATES, draw_seed, make_sampling_batch, plain_sampling
from nanovllm.engine.sequence import Sequence
from nanovllm.layers import sampling_torch
from nanovllm.layers.sampler import Filters, Sampler, SamplingBatch
from nanovllm.sampling_params import SamplingParams

NUM_DRAWS = 4000
P_VALUE = 1e-3  # a chi-square p-value below this fails
MIN_EXPECTED = 5  # draws expected per chi-square bin at least (smaller levels are merged)
MARGIN = 1e-4  # a filter threshold must be this far from every token's value (log-ratio or mass)
TIE_GAP = 1e-5  # Triton vs torch: two tokens' Gumbel scores this close are a rounding near-tie


def seed_tensor(n: int, seed: int) -> torch.Tensor:
    """``n`` draw seeds in [0, 2**32), a fixed sequence for each ``seed``."""
    return torch.randint(0, 1 << 32, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)


# ---- the reference: which tokens a filtered draw may return, and how often ---------------------


@dataclass
class Level:
    tokens: list[int]  # the token ids sharing one logit value
    kept: int  # how many of them the filters keep
    mass: float  # their share of the renormalised distribution


@dataclass
class Expected:
    levels: list[Level]  # levels with kept > 0, most likely first
    support: int  # tokens with a finite logit
    stage_sizes: dict  # tokens kept after each filter that is on, in order

    @property
    def allowed(self) -> set[int]:
        return {t for level in self.levels for t in level.tokens}

    @property
    def num_kept(self) -> int:
        return sum(level.kept for level in self.levels)


def reference(
    row: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> Expected:
    """Sort the probabilities of softmax(row / temperature) (float64), then min-p (probability >=
    min_p * the largest), top-k (the first top_k), top-p (renormalised over what is left, keep a token
    while the mass before it is < top_p: the token that crosses top_p stays)."""
    x = row.double() / temperature
    order = torch.sort(x, descending=True, stable=True).indices
    xs = x[order]
    p = torch.softmax(xs, dim=0)
    keep = torch.isfinite(xs)
    sizes = {"support": int(keep.sum())}
    if min_p > 0:
        log_ratio = xs - xs[0]
        near = keep & ((log_ratio - torch.log(torch.tensor(min_p, dtype=torch.float64))).abs() < MARGIN)
        assert not near.any(), f"min_p={min_p} is within {MARGIN} of a token's probability ratio: pick another"
        keep &= log_ratio >= torch.log(torch.tensor(min_p, dtype=torch.float64))
        sizes["min_p"] = int(keep.sum())
    if top_k > 0:
        keep &= torch.arange(len(xs)) < top_k
        sizes["top_k"] = int(keep.sum())
    if top_p < 1.0:
        q = torch.where(keep, p, 0.0)
        q = q / q.sum()
        before = q.cumsum(0) - q
        near = keep & ((before - top_p).abs() < MARGIN)
        assert not near.any(), f"top_p={top_p} is within {MARGIN} of a token's cumulative mass: pick another"
        keep &= before < top_p
        sizes["top_p"] = int(keep.sum())
    kept_mass = float(p[keep].sum())
    values = row[order]  # levels: runs of equal logits in the sorted order
    levels, start = [], 0
    for i in range(1, len(xs) + 1):
        if i == len(xs) or values[i] != values[start]:
            kept = int(keep[start:i].sum())
            if kept:
                mass = float(p[start:i][keep[start:i]].sum()) / kept_mass
                levels.append(Level(order[start:i].tolist(), kept, mass))
            start = i
    return Expected(levels, sizes["support"], sizes)


def chi_square_p_value(observed: list[float], expected: list[float]) -> float:
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)))


def check_draws(tokens: torch.Tensor, expected: Expected, what: str) -> None:
    """Every draw in the allowed set, at most ``kept`` distinct tokens per level, and the levels'
    shares of the draws as the reference's (chi-square, levels merged to >= MIN_EXPECTED draws)."""
    n = tokens.numel()
    counts = Counter(tokens.tolist())
    allowed = expected.allowed
    outside = {t: c for t, c in counts.items() if t not in allowed}
    assert not outside, (
        f"{what}: drew tokens outside the allowed set ({expected.num_kept} tokens) {{token: draws}}: {outside}"
    )
    for level in expected.levels:
        drawn = sorted(set(level.tokens) & counts.keys())
        assert len(drawn) <= level.kept, (
            f"{what}: {len(drawn)} distinct tokens drawn from a level of {len(level.tokens)} equal logits "
            f"of which {level.kept} are kept: {drawn}"
        )
    bins = []  # [observed, expected, first level's tokens]
    for level in expected.levels:
        obs, exp = sum(counts[t] for t in level.tokens), level.mass * n
        if bins and bins[-1][1] < MIN_EXPECTED:
            bins[-1][0] += obs
            bins[-1][1] += exp
        else:
            bins.append([obs, exp, level.tokens[:3]])
    if len(bins) > 1 and bins[-1][1] < MIN_EXPECTED:
        last = bins.pop()
        bins[-1][0] += last[0]
        bins[-1][1] += last[1]
    if len(bins) < 2:
        return
    p = chi_square_p_value([b[0] for b in bins], [b[1] for b in bins])
    worst = sorted(bins, key=lambda b: -((b[0] - b[1]) ** 2) / b[1])[:5]
    assert p >= P_VALUE, (
        f"{what}: the draws do not follow the reference distribution (chi-square p = {p:.3g} over {len(bins)} "
        f"bins); worst bins (drawn, expected, tokens): {[(b[0], round(b[1], 1), b[2]) for b in worst]}"
    )


def filtered_draws(row: torch.Tensor, seeds: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0, beside_top_p: bool = False) -> torch.Tensor:
    """``sample_filtered`` on copies of ``row``, one per seed, with the candidates the engine would use:
    for a top-k row, top_k of them and no vocabulary pass, unless ``beside_top_p`` (the batch also
    holds a row without top-k); else NUM_CANDIDATES."""
    n = seeds.numel()
    logits = row.unsqueeze(0).repeat(n, 1)
    all_top_k = top_k > 0 and not beside_top_p
    return sampling_torch.sample_filtered(
        logits, torch.full((n,), temperature), seeds, torch.full((n,), top_k), torch.full((n,), top_p),
        torch.full((n,), min_p) if min_p > 0 else None,
        top_k if all_top_k else max(top_k, NUM_CANDIDATES), all_top_k,
    )


def seq_with(params: SamplingParams, num_completion: int = 0, prompt: list[int] | None = None) -> Sequence:
    """A sequence with ``num_completion`` generated tokens (100, 101, ...)."""
    seq = Sequence(prompt or [1, 2, 3], params, block_size=16)
    for t in range(num_completion):
        seq.append_token(100 + t)
    return seq


def make_batch(seqs: list[Sequence], vocab: int) -> SamplingBatch:
    return make_sampling_batch(seqs, vocab, torch.device("cpu"), lambda values, dtype: torch.tensor(values, dtype=dtype))


def sample_seqs(seqs: list[Sequence], logits: torch.Tensor):
    """The engine's path: ``make_sampling_batch`` on the sequences, then the Sampler."""
    return Sampler()(logits, make_batch(seqs, logits.size(1)))


# ---- logits ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_logits(ckpt_tied, hf_ref) -> torch.Tensor:
    """Next-token logits [4, 512] of the tiny tied checkpoint after four random prompts (transformers)."""
    model = hf_ref.model(ckpt_tied.path)
    with torch.no_grad():
        rows = [model(torch.tensor([p])).logits[0, -1] for p in random_prompts(3, [5, 9, 17, 30])]
    return torch.stack(rows).float()


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
    assert expected.num_kept < expected.support, f"{what}: the filters keep all {expected.support} tokens"
    sizes = list(expected.stage_sizes.items())
    for (before_name, before), (name, after) in zip(sizes, sizes[1:]):
        assert after < before, f"{what}: {name} keeps all {before} tokens left by {before_name}; pick a tighter one"


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
    [(name, False) for name in TIE_SETTINGS] + [(name, True) for name, p in TIE_SETTINGS.items() if p.get("top_k")],
)
def test_filtered_draws_with_ties(setting, beside_top_p):
    """Top-k rows also as in a batch that holds a row without top-k (NUM_CANDIDATES candidates out of
    600 tokens, and top-p normalises over what top-k kept, not over the vocabulary)."""
    params = TIE_SETTINGS[setting]
    row = tie_row()
    what = f"tie row, {params}" + (", beside a top-p row" if beside_top_p else "")
    expected = reference(row, **params)
    assert_filters_bite(expected, what)
    tokens = filtered_draws(row, seed_tensor(NUM_DRAWS, len(setting)), **params, beside_top_p=beside_top_p)
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
    """2000 equal logits, top_p 0.3002: 601 tokens are kept (the mass before the 601st is 0.3), so at
    most 601 distinct tokens may be drawn out of 4000 draws."""
    row = torch.zeros(2000)
    expected = reference(row, 1.0, top_p=0.3002)
    assert expected.num_kept == 601
    tokens = filtered_draws(row, seed_tensor(NUM_DRAWS, 8), 1.0, top_p=0.3002)
    check_draws(tokens, expected, "exactly flat row, top_p=0.3002")


# ---- the Sampler on a batch of filtered, plain and greedy rows -------------------------------------

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


# ---- the plain temperature draw -------------------------------------------------------------------


def test_gumbel_argmax_distribution(model_logits):
    """Rows at T = 1, 0.7, 1.5 and 0 (greedy), and one with its three most likely tokens masked to
    -inf; the seeds are a seeded request's per-step draw seeds."""
    masked = model_logits[0].clone()
    masked[masked.topk(3).indices] = float("-inf")
    rows = torch.stack([model_logits[0], model_logits[1], model_logits[2], model_logits[3], masked])
    temps = torch.tensor([1.0, 0.7, 1.5, 0.0, 1.0])
    width = len(temps)
    seeds = torch.tensor([draw_seed(1234, step) for step in range(NUM_DRAWS * width)])
    tokens = sampling_torch.gumbel_argmax(rows.repeat(NUM_DRAWS, 1), temps.repeat(NUM_DRAWS), seeds)
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
    tokens = sampling_torch.gumbel_argmax(logits, temps, seed_tensor(64, 11))
    greedy = torch.arange(0, 64, 2)
    want = torch.tensor([int(torch.nonzero(r == r.max())[0]) for r in logits[greedy]])
    assert torch.equal(tokens[greedy], want), (tokens[greedy].tolist(), want.tolist())
    assert tokens[4] == 17


@pytest.mark.parametrize("temperature", [1e-39, 1e-38])
def test_tiny_temperature_draws_the_argmax(temperature):
    """SamplingParams accepts any finite temperature > 0, and softmax(logits / T) at such a T (float64)
    puts all its mass on the argmax: every draw must be the argmax (or the temperature refused), also
    when logits / T overflows float32 (the second row's positive logits reach 3.5e39)."""
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
        assert got == want, f"T={temperature}, seed {seed}: drew {got}, the argmax is {want} (probability 1)"


# ---- seeds ------------------------------------------------------------------------------------------

VOCAB = 2000


SEEDED_TARGETS = {
    "plain": SamplingParams(temperature=0.9),
    "top_p": SamplingParams(temperature=1.1, top_p=0.8),
    "all_three": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02),
}
OTHER_ROWS = [  # batch neighbours: greedy, unseeded, a top-k past NUM_CANDIDATES, min-p, another seed
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.0, top_k=700),
    SamplingParams(temperature=0.5, min_p=0.3, seed=99),
    SamplingParams(temperature=1.0, top_p=0.95, seed=3),
]


NUM_SEEDS = 60


@pytest.mark.parametrize("target", list(SEEDED_TARGETS))
def test_seeded_row_independent_of_batch(target):
    """NUM_SEEDS seeded copies of one row (their seeds and steps differ), each drawn alone, then all in
    one batch, then scattered in random order among twice as many other rows (other logits, other
    settings): each copy draws the same token every time."""
    g = torch.Generator().manual_seed(12)
    target_logits = 2.0 * torch.randn(VOCAB, generator=g)
    others = 2.0 * torch.randn(len(OTHER_ROWS), VOCAB, generator=g)
    copies = [seq_with(replace(SEEDED_TARGETS[target], seed=s * 7919), s % 4) for s in range(NUM_SEEDS)]
    alone = [int(sample_seqs([seq], target_logits.unsqueeze(0)).token_ids[0]) for seq in copies]
    assert len(set(alone)) > 10, f"{target}: the draws hardly vary with the seed: {alone}"
    together = sample_seqs(copies, target_logits.repeat(NUM_SEEDS, 1)).token_ids.tolist()
    assert together == alone, f"{target}: all copies in one batch draw {together}, alone {alone}"

    entries = [(seq, target_logits) for seq in copies]
    for j in range(2 * NUM_SEEDS):
        entries.append((seq_with(OTHER_ROWS[j % len(OTHER_ROWS)], 3), others[j % len(OTHER_ROWS)]))
    order = torch.randperm(len(entries), generator=g).tolist()
    out = sample_seqs([entries[i][0] for i in order], torch.stack([entries[i][1] for i in order])).token_ids
    scattered = [int(out[order.index(k)]) for k in range(NUM_SEEDS)]
    assert scattered == alone, (
        f"{target}: copies scattered among other rows draw {scattered}, alone {alone}; differing copies "
        f"{[k for k in range(NUM_SEEDS) if scattered[k] != alone[k]]}"
    )


def test_draw_seed_range_and_spread():
    values = {draw_seed(seed, step) for seed in range(100) for step in range(100)}
    assert all(0 <= v < 1 << 32 for v in values)
    assert len(values) == 100 * 100, "two (seed, step) pairs share a draw seed"
    assert draw_seed(5, 0) == draw_seed(5, 0) and draw_seed(-3, 2) >= 0


# ---- penalties --------------------------------------------------------------------------------------


def penalised_reference(row: list[float], prompt: list[int], output: list[int], repetition: float,
                        presence: float, frequency: float) -> list[float]:
    out = list(row)
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t, count in Counter(output).items():
        out[t] -= frequency * count + presence
    return out


PENALISED = {  # row -> (prompt, output, repetition, presence, frequency)
    0: ([3, 3, 7, 11, 0], [7, 7, 7, 20, 3], 1.3, 0.5, 0.25),
    2: ([1, 2, 2, 5], [], 0.7, 0.0, 0.0),  # repetition < 1 raises the prompt's tokens; no output yet
    3: ([9], [4, 4, 9, 31, 31, 31, 31], 1.0, -0.4, 1.5),  # presence/frequency only, one negative
    5: ([31, 30], [30, 12], 2.0, 2.0, -2.0),
}


def occurrences(token_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into the penalised rows, token id), one pair per token occurrence."""
    index = [j for j, tokens in enumerate(token_lists) for _ in tokens]
    ids = [t for tokens in token_lists for t in tokens]
    return torch.tensor(index, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)


def test_apply_penalties_matches_loop():
    """Rows 1, 4 and 6 are not penalised and must stay bit for bit; the others as the loop says."""
    g = torch.Generator().manual_seed(13)
    logits = 3.0 * torch.randn(7, 32, generator=g)  # both signs
    logits[0, 7], logits[0, 3], logits[5, 30] = -2.5, 1.75, 0.0
    original = logits.clone()
    settings = list(PENALISED.values())
    sampling_torch.apply_penalties(
        logits, torch.tensor(list(PENALISED)), *(torch.tensor([s[i] for s in settings]) for i in (2, 3, 4)),
        occurrences([s[0] for s in settings]), occurrences([s[1] for s in settings]),
    )
    for i in range(logits.size(0)):
        if i not in PENALISED:
            assert torch.equal(logits[i], original[i]), f"row {i} is not penalised but changed"
            continue
        want = torch.tensor(penalised_reference(original[i].double().tolist(), *PENALISED[i]), dtype=torch.float64)
        err = (logits[i].double() - want).abs()
        assert err.max() < 1e-5, (
            f"row {i}, {PENALISED[i]}: tokens {torch.nonzero(err >= 1e-5).flatten().tolist()} are "
            f"{logits[i][err >= 1e-5].tolist()}, want {want[err >= 1e-5].tolist()}"
        )


def test_sampler_greedy_after_penalties_and_suppression():
    """Greedy rows take the argmax of the penalised logits, with the min_tokens ids masked (the
    reference's argmax is each time a token the penalty or the suppression moved)."""
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(3, 64, generator=g)
    logits[0, 5], logits[0, 6] = 4.0, 3.0  # 5 is in the output, penalised below 6
    logits[1, 9], logits[1, 8] = 5.0, 4.5  # 9 is EOS, suppressed below min_tokens
    logits[2, 9], logits[2, 8] = 5.0, 4.5  # min_tokens reached: no longer suppressed
    seqs = [
        seq_with(SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5), prompt=[1, 5]),
        seq_with(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]), 1),
        seq_with(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]), 2),
    ]
    seqs[0].append_token(5)
    seqs[0].append_token(5)
    want = [6, 8, 9]
    reference_row = penalised_reference(logits[0].tolist(), [1, 5], [5, 5], 1.0, 0.5, 1.0)
    assert max(range(64), key=reference_row.__getitem__) == want[0]
    out = sample_seqs(seqs, logits)
    assert out.token_ids.tolist() == want
    assert out.logprobs is None


# ---- log-probabilities ------------------------------------------------------------------------------


def check_logprobs(raw: torch.Tensor, tokens: torch.Tensor, got, num: int, what: str, exact_ids: bool = True) -> None:
    """Against log_softmax of ``raw`` in float64. ``exact_ids``: the top ids are the reference's (no
    equal logits among them); otherwise any ids whose log-probabilities are the largest."""
    sampled, top_values, top_ids = got
    want = torch.log_softmax(raw.double(), dim=-1)
    assert top_values.shape == top_ids.shape == (raw.size(0), num), (what, top_values.shape)
    assert (sampled.double() - want.gather(1, tokens.unsqueeze(1)).squeeze(1)).abs().max() < 1e-5, what
    assert (top_values.double() - want.gather(1, top_ids)).abs().max() < 1e-5, what
    want_values, want_ids = want.topk(num, dim=-1)
    assert (top_values.double() - want_values).abs().max() < 1e-5, f"{what}: not the {num} largest"
    if exact_ids:
        assert torch.equal(top_ids, want_ids), f"{what}: top ids {top_ids.tolist()}, want {want_ids.tolist()}"
    assert all(len(set(ids)) == num for ids in top_ids.tolist()), f"{what}: repeated ids {top_ids.tolist()}"
    assert (top_values[:, 1:] <= top_values[:, :-1]).all(), f"{what}: not ordered"


def test_top_logprobs(model_logits):
    big = 40.0 * torch.randn(2, 512, generator=torch.Generator().manual_seed(15))  # far from 0
    raw = torch.cat([model_logits, big])
    tokens = torch.tensor([0, 511, 100, int(model_logits[3].argmax()), 7, 300])
    check_logprobs(raw, tokens, sampling_torch.top_logprobs(raw, tokens, 5), 5, "float32")
    raw16 = raw.bfloat16()  # equal values are likely: the top ids are checked by their values
    check_logprobs(raw16, tokens, sampling_torch.top_logprobs(raw16, tokens, 3), 3, "bfloat16", exact_ids=False)


def test_sampler_logprobs_from_raw_logits(model_logits):
    """Rows with penalties and min_tokens suppression still report log_softmax of the raw logits, for
    their sampled token; rows that asked for none are left out."""
    logits = model_logits.clone()
    suppressed = int(model_logits[0].argmax())
    seqs = [
        seq_with(SamplingParams(temperature=0.0, logprobs=3, min_tokens=1, stop_token_ids=[suppressed])),
        seq_with(SamplingParams(temperature=0.7, seed=1)),
        seq_with(SamplingParams(temperature=1.0, top_k=4, repetition_penalty=1.5, logprobs=2, seed=2), 2),
        seq_with(SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=0), 1),
    ]
    out = sample_seqs(seqs, logits)
    assert torch.equal(logits, model_logits), "the sampler changed its input logits"
    assert out.token_ids[0] != suppressed
    rows = torch.tensor([0, 2, 3])
    check_logprobs(model_logits[rows], out.token_ids[rows], out.logprobs, 3, "sampler logprobs")


# ---- the Triton draw under the interpreter ----------------------------------------------------------


def triton_case(vocab: int, dtype: torch.dtype, seed: int, rows_per_temperature: int = 6, stride_pad: int = 0,
                ties: bool = False, shift: float = 0.0, chunk_blocks: int | None = None) -> dict:
    """``sampling_triton.gumbel_argmax`` against ``sampling_torch.gumbel_argmax`` on the same inputs
    (logits around ``shift``); a differing token is a near-tie when the two tokens' Gumbel scores are
    within TIE_GAP. ``chunk_blocks``: programs of that many BLOCKs each (default: the kernel's CHUNK),
    so that a small vocabulary spans several programs."""
    from nanovllm.layers import sampling_triton

    g = torch.Generator().manual_seed(seed)
    temps = torch.tensor([0.0, 0.3, 1.0, 2.5]).repeat_interleave(rows_per_temperature)
    n = temps.numel()
    wide = (shift + 1.5 * torch.randn(n, vocab + stride_pad, generator=g)).to(dtype)
    if ties:  # equal maxima in other blocks and in the same lane of another block; masked tokens
        wide[:, :vocab:97] = float("-inf")
        wide[:, [5, 5 + sampling_triton.BLOCK, vocab - 1]] = 30.0
    logits = wide[:, :vocab]
    seeds = seed_tensor(n, seed)
    chunk = sampling_triton.BLOCK * chunk_blocks if chunk_blocks else sampling_triton.CHUNK
    got = sampling_triton.gumbel_argmax(logits, temps, seeds, chunk=chunk)
    want = sampling_torch.gumbel_argmax(logits, temps, seeds)
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
            scores = scores / t + sampling_torch.gumbel(seeds[i : i + 1], ids)[0]
        gap = float((scores[0] - scores[1]).abs())
        if t > 0 and gap <= TIE_GAP:
            near_ties += 1
        else:
            mismatches.append(dict(row=i, temperature=t, triton=a, torch=b, score_gap=gap))
    return dict(rows=n, near_ties=near_ties, mismatches=mismatches, distinct=len(set(want.tolist())))


def triton_skip_case(chunk_blocks: int | None = None) -> dict:
    """Rows with a negative temperature are skipped: their ``out`` entries keep what was there; the
    others get the torch draw's tokens."""
    from nanovllm.layers import sampling_triton

    g = torch.Generator().manual_seed(30)
    logits = torch.randn(6, 3000, generator=g) * 2
    temps = torch.tensor([0.7, -1.0, 0.0, -1.0, 1.3, -0.5])
    seeds = seed_tensor(6, 30)
    out = torch.full((6,), -7, dtype=torch.int64)
    chunk = sampling_triton.BLOCK * chunk_blocks if chunk_blocks else sampling_triton.CHUNK
    got = sampling_triton.gumbel_argmax(logits, temps, seeds, out=out, chunk=chunk)
    drawn = [0, 2, 4]
    want = sampling_torch.gumbel_argmax(logits[drawn], temps[drawn], seeds[drawn])
    return dict(returned_out=got is out, out=out.tolist(), want=want.tolist())


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
    "float32_vocab4100_ties_chunks_of_one_block": lambda: triton_case(4100, torch.float32, 28, ties=True, chunk_blocks=1),
    "bfloat16_vocab5000_strided_chunks_of_two_blocks": lambda: triton_case(
        5000, torch.bfloat16, 29, stride_pad=13, chunk_blocks=2),
    "float32_vocab3000_all_negative_chunks": lambda: triton_case(3000, torch.float32, 31, shift=-60.0, chunk_blocks=1),
}


def run_triton_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    return run_cases(TRITON_CASES)


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
    assert not result["mismatches"], f"{case}: Triton and torch draw different tokens: {result['mismatches']}"
    assert result["distinct"] >= 3, f"{case}: the rows hardly differ: {result}"


# ---- make_sampling_batch ----------------------------------------------------------------------------

EOS = 0


def request_seqs(prompt: list[int], params: SamplingParams, completion: list[int]) -> list[Sequence]:
    """The sequences of one request, EOS added to the min_tokens ids as the engine does, with
    ``completion`` generated already."""
    seqs = Request(prompt, params, block_size=16, eos_token_ids=[EOS]).seqs
    for seq in seqs:
        for t in completion:
            seq.append_token(t)
    return seqs


def pairs(t: tuple[torch.Tensor, torch.Tensor] | None) -> list[tuple[int, int]]:
    """(row, token id) pairs as a sorted list."""
    return sorted(zip(t[0].tolist(), t[1].tolist())) if t is not None else []


def test_make_sampling_batch_mixed():
    """Six sequences of five requests (one with n=2), each row using a different part of the batch."""
    vocab = 1000
    seqs = [
        # 0: seeded, top-p (top_k -1 = off), below min_tokens: suppresses 7 and EOS, not 5000 (past the vocabulary)
        *request_seqs([1, 2, 3, 2], SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, seed=5, min_tokens=3,
                                                   stop_token_ids=[7, 5000], logprobs=2), [4]),
        # 1: greedy with a repetition penalty, min_tokens reached: nothing suppressed; top_k ignored (greedy)
        *request_seqs([8, 8], SamplingParams(temperature=0.0, repetition_penalty=1.2, min_tokens=1, top_k=3), [5]),
        # 2: plain, presence and frequency penalties
        *request_seqs([9], SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3), [6, 6, 1]),
        # 3, 4: n=2, seeds 10 and 11; top-k and min-p; ignore_eos: nothing suppressed
        *request_seqs([3], SamplingParams(temperature=1.2, top_k=40, min_p=0.1, seed=10, n=2, min_tokens=5,
                                          ignore_eos=True, logprobs=5), [2, 2]),
        # 5: seeded plain, min_tokens without stop ids: EOS suppressed
        *request_seqs([4, 4, 4], SamplingParams(temperature=0.5, seed=123, logprobs=0, min_tokens=1), []),
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
    seqs = [seq_with(SamplingParams(temperature=1.0, top_k=k, top_p=0.9 if k == 0 else 1.0)) for k in top_ks]
    f = make_batch(seqs, vocab).filters
    assert f.top_k.tolist() == [min(k, vocab) for k in top_ks]
    assert (f.num_candidates, f.all_top_k) == (num_candidates, all_top_k)
    assert f.min_p is None
    assert f.num_candidates >= max(f.top_k.tolist())


if __name__ == "__main__":
    print(json.dumps(run_triton_cases()))


# ---- plain_sampling: what a CUDA graph draws by itself ---------------------------------------------


def test_plain_sampling_temperatures_and_seeds():
    """Greedy rows get temperature 0; a seeded row the same draw seed as make_sampling_batch gives
    it; unseeded rows a seed from the generator in [0, 2**32)."""
    seqs = [
        *request_seqs([1, 2], SamplingParams(temperature=0.0), [3]),
        *request_seqs([4], SamplingParams(temperature=0.8, seed=9), [5, 6]),
        *request_seqs([7], SamplingParams(temperature=1.5), []),
        *request_seqs([2], SamplingParams(temperature=0.6, seed=4, n=2), [8]),
    ]
    temperatures, seeds = plain_sampling(seqs, np.random.default_rng(0))
    assert temperatures == pytest.approx([0.0, 0.8, 1.5, 0.6, 0.6])
    assert seeds[1] == draw_seed(9, 2) and seeds[3] == draw_seed(4, 1) and seeds[4] == draw_seed(5, 1)
    assert all(isinstance(s, int) and 0 <= s < 1 << 32 for s in seeds)
    batch = make_batch(seqs, 1000)
    assert batch.seeds[[1, 3, 4]].tolist() == [seeds[1], seeds[3], seeds[4]]
    assert batch.temperatures.tolist() == pytest.approx(temperatures)


@pytest.mark.parametrize("params, completion", [
    (SamplingParams(temperature=0.7, top_p=0.9), []),
    (SamplingParams(temperature=0.7, top_k=5), []),
    (SamplingParams(temperature=0.7, min_p=0.1), []),
    (SamplingParams(temperature=0.0, repetition_penalty=1.1), []),
    (SamplingParams(temperature=0.7, presence_penalty=0.2), []),
    (SamplingParams(temperature=0.7, logprobs=0), []),
    (SamplingParams(temperature=0.7, min_tokens=2), [5]),
])
def test_plain_sampling_refuses_any_other_setting(params, completion):
    """One row that needs more than a temperature and a seed sends the whole batch to the sampler."""
    seqs = request_seqs([1], SamplingParams(temperature=0.5), []) + request_seqs([2, 3], params, completion)
    assert plain_sampling(seqs, np.random.default_rng(0)) is None
    assert plain_sampling(seqs[:1], np.random.default_rng(0)) is not None


def test_plain_sampling_after_min_tokens():
    """min_tokens only matters until it is reached."""
    seqs = request_seqs([1], SamplingParams(temperature=0.7, min_tokens=2), [5, 6])
    assert plain_sampling(seqs, np.random.default_rng(0)) is not None
