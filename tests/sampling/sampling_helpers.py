"""The references of the sampling tests, computed here, independently, from the logits.

Which tokens a filtered draw may return, and how often: a reference in float64 sorts the
probabilities and applies each filter in turn (temperature, then min-p, top-k and top-p, in vLLM's
order). Tokens with equal logits form one level: which of them a cut inside the level keeps is
arbitrary, but how many it keeps is not, so ``check_draws`` checks the number of distinct tokens
drawn per level and the level's share of the draws (a chi-square test at p = 1e-3 over a fixed
sequence of seeds, so a run is deterministic). Also sequences sampled the engine's way
(``make_sampling_batch``, then the Sampler).
"""

from collections import Counter
from dataclasses import dataclass
from random import Random

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step import SamplingRows, build_step
from nanovllm.features.attach import attach_processors
from nanovllm.sampling import torch_ops
from nanovllm.sampling.extras import NUM_CANDIDATES
from nanovllm.sampling.sampler import Sampler, SamplingBatch, make_sampling_batch
from nanovllm.sampling_params import SamplingParams

NUM_DRAWS = 4000
P_VALUE = 1e-3  # a chi-square p-value below this fails
MIN_EXPECTED = 5  # draws expected per chi-square bin at least (smaller levels are merged)
MARGIN = 1e-4  # a filter threshold must be this far from every token's value (log-ratio or mass)


def seed_tensor(n: int, seed: int) -> torch.Tensor:
    """``n`` draw seeds in [0, 2**32), a fixed sequence for each ``seed``."""
    return torch.randint(
        0, 1 << 32, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64
    )


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
    min_p * the largest), top-k (the first top_k), top-p (renormalised over what is left, keep a
    token while the mass before it is < top_p: the token that crosses top_p stays)."""
    x = row.double() / temperature
    order = torch.sort(x, descending=True, stable=True).indices
    xs = x[order]
    p = torch.softmax(xs, dim=0)
    keep = torch.isfinite(xs)
    sizes = {"support": int(keep.sum())}
    if min_p > 0:
        log_ratio = xs - xs[0]
        near = keep & (
            (log_ratio - torch.log(torch.tensor(min_p, dtype=torch.float64))).abs() < MARGIN
        )
        assert not near.any(), (
            f"min_p={min_p} is within {MARGIN} of a token's probability ratio: pick another"
        )
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
        assert not near.any(), (
            f"top_p={top_p} is within {MARGIN} of a token's cumulative mass: pick another"
        )
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
        f"{what}: drew tokens outside the allowed set ({expected.num_kept} tokens) "
        f"{{token: draws}}: {outside}"
    )
    for level in expected.levels:
        drawn = sorted(set(level.tokens) & counts.keys())
        assert len(drawn) <= level.kept, (
            f"{what}: {len(drawn)} distinct tokens drawn from a level of {len(level.tokens)} "
            "equal logits "
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
        f"{what}: the draws do not follow the reference distribution (chi-square p = {p:.3g} "
        f"over {len(bins)} bins); worst bins (drawn, expected, tokens): "
        f"{[(b[0], round(b[1], 1), b[2]) for b in worst]}"
    )


def filtered_draws(
    row: torch.Tensor,
    seeds: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    beside_top_p: bool = False,
) -> torch.Tensor:
    """``sample_filtered`` on copies of ``row``, one per seed, with the candidates the engine would
    use: for a top-k row, top_k of them and no vocabulary pass, unless ``beside_top_p`` (the batch
    also holds a row without top-k); else NUM_CANDIDATES."""
    n = seeds.numel()
    logits = row.unsqueeze(0).repeat(n, 1)
    all_top_k = top_k > 0 and not beside_top_p
    return torch_ops.sample_filtered(
        logits,
        torch.full((n,), temperature),
        seeds,
        torch.full((n,), top_k),
        torch.full((n,), top_p),
        torch.full((n,), min_p) if min_p > 0 else None,
        top_k if all_top_k else max(top_k, NUM_CANDIDATES),
        all_top_k,
    )


def seq_with(
    params: SamplingParams, num_completion: int = 0, prompt: list[int] | None = None
) -> Sequence:
    """A sequence with ``num_completion`` generated tokens (100, 101, ...)."""
    seq = Sequence(prompt or [1, 2, 3], params, block_size=16)
    attach_processors([seq], [])
    for t in range(num_completion):
        seq.append_placeholder(-1)
        seq.set_token(len(seq) - 1, 100 + t)
    return seq


def step_rows(seqs: list[Sequence], rng: Random | None = None) -> SamplingRows:
    """The sampling rows of a decode step of ``seqs``, their processors' contributions included."""
    return build_step(seqs, False, rng or Random(0)).sampling


def make_batch(seqs: list[Sequence], vocab: int) -> SamplingBatch:
    """The engine's rows of ``seqs`` (unseeded rows draw from a fixed generator) as the sampler's
    tensors."""
    rows = step_rows(seqs)
    return make_sampling_batch(rows, vocab, lambda values, dtype: torch.tensor(values, dtype=dtype))


def sample_seqs(seqs: list[Sequence], logits: torch.Tensor):
    """The engine's path: ``make_sampling_batch`` on the sequences, then the Sampler."""
    return Sampler()(logits, make_batch(seqs, logits.size(1)))
