"""The plain description of one step that the engine core hands the executor (pure Python): what
every rank computes, and on rank 0 how each row samples. Lists of ints and small dataclasses only,
so it pickles compactly to the worker processes; no ``Sequence`` crosses that boundary."""

from dataclasses import dataclass, replace
from itertools import chain
from random import Random

import numpy as np

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, step: int) -> int:
    """The 32-bit noise seed of a seeded request's ``step``-th token (a splitmix64 finaliser of
    both): the draw depends on nothing else, so the batch around it does not change it."""
    x = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & 0xFFFFFFFF


@dataclass
class SamplingRows:
    """How each row of a step samples (rank 0 only). ``plain``: every row samples with a
    temperature (0: greedy) and a draw seed alone, which the fused draw does on its own; rows of
    any other step go through the whole sampler, with ``params`` for filters and log-probabilities.
    ``token_bitmask``: the rows with a grammar and, one row each, the tokens their grammar allows
    (bit ``t % 32`` of int32 word ``t // 32`` set for token ``t``); the sampler masks the others."""

    temperatures: list[float]  # 0 = greedy
    seeds: list[int]  # each row's draw seed in [0, 2**32)
    params: list[SamplingParams]
    plain: bool
    suppressed: list[list[int]] | None = (
        None  # per row: ids masked before min_tokens (None: no row has any)
    )
    penalty_tokens: list[tuple[list[int], list[int]] | None] | None = (
        None  # per row: (prompt, output) ids
    )
    token_bitmask: tuple[list[int], np.ndarray] | None = None  # (rows, [len(rows), words] int32)


@dataclass
class PromptScoring:
    """Prompt tokens a prefill step scores (``prompt_logprobs``). Row ``rows[j]`` scores
    ``counts[j]`` consecutive prompt tokens, the first at position ``firsts[j]``: the logits at
    step token ``indices[i]`` (an index into the step's tokens) score ``targets[i]``, the prompt
    token after it, and give the ``num`` most likely tokens (each row keeps its own ``nums[j]``)."""

    rows: list[int]
    firsts: list[int]
    counts: list[int]
    nums: list[int]
    indices: list[int]
    targets: list[int]

    @property
    def num(self) -> int:
        return max(self.nums)


@dataclass
class Step:
    """One forward pass. Sequence ``i`` has ``num_computed[i]`` tokens in the cache and computes
    ``num_new[i]`` more (decode: one), whose ids are ``token_ids`` (all sequences', in order); a
    token the host does not know yet is -1, and ``prev_rows[i]`` names the row of the previous
    step's sampled ids that holds it. ``block_tables`` are empty for a step without a cache (the
    warm-up). ``sampling`` is set on rank 0, and on the other ranks for a plain step (``for_workers``)."""

    is_prefill: bool
    token_ids: list[int]
    num_computed: list[int]
    num_new: list[int]
    block_tables: list[list[int]]
    prev_rows: list[int] | None = None
    sampling: SamplingRows | None = None
    prompt_scoring: PromptScoring | None = None  # every rank joins the LM head's gather for it

    @property
    def num_seqs(self) -> int:
        return len(self.num_new)

    def for_workers(self) -> "Step":
        """What ranks other than 0 need: everything but the sampling rows, save a plain step's
        temperatures and draw seeds (a decode graph draws on every rank, see cuda_graphs)."""
        rows = self.sampling
        plain = (
            None
            if rows is None or not rows.plain
            else SamplingRows(rows.temperatures, rows.seeds, [], True)
        )
        return replace(self, sampling=plain)


def build_step(seqs: list[Sequence], is_prefill: bool, rng: Random) -> Step:
    """The step that computes each sequence's ``num_scheduled_tokens`` (set by the scheduler)."""
    if is_prefill:
        token_ids = list(chain.from_iterable(seq.scheduled_token_ids() for seq in seqs))
        num_computed = [seq.num_cached_tokens for seq in seqs]
        num_new = [seq.num_scheduled_tokens for seq in seqs]
        prev_rows = None
    else:
        token_ids = [seq.last_token for seq in seqs]
        num_computed = [seq.num_tokens - 1 for seq in seqs]
        num_new = [1] * len(seqs)
        prev_rows = [seq.pending_row if seq.num_pending else -1 for seq in seqs]
        if max(prev_rows) < 0:
            prev_rows = None
    scoring = prompt_scoring(seqs, num_computed, num_new) if is_prefill else None
    return Step(
        is_prefill,
        token_ids,
        num_computed,
        num_new,
        [seq.block_table for seq in seqs],
        prev_rows,
        sampling_rows(seqs, rng),
        scoring,
    )


def prompt_scoring(
    seqs: list[Sequence], num_computed: list[int], num_new: list[int]
) -> PromptScoring | None:
    """The prompt tokens this prefill scores: for each sequence that owes prompt log-probabilities,
    those after the tokens it computes, within its prompt, not scored before (a preempted sequence
    computes its prompt again)."""
    scoring = None
    offset = 0  # the sequence's first token among the step's
    for i, seq in enumerate(seqs):
        if seq.scores_prompt:
            start = max(
                num_computed[i], len(seq.prompt_logprobs) - 1
            )  # the logits at p score token p + 1
            end = min(num_computed[i] + num_new[i], seq.num_prompt_tokens - 1)
            if start < end:
                scoring = scoring or PromptScoring([], [], [], [], [], [])
                scoring.rows.append(i)
                scoring.firsts.append(start + 1)
                scoring.counts.append(end - start)
                scoring.nums.append(seq.sampling_params.prompt_logprobs)
                scoring.indices += range(
                    offset + start - num_computed[i], offset + end - num_computed[i]
                )
                scoring.targets += seq.token_ids[start + 1 : end + 1]
        offset += num_new[i]
    return scoring


def sampling_rows(seqs: list[Sequence], rng: Random) -> SamplingRows:
    """Each sequence's sampling settings for its next token. Unseeded rows draw a seed from ``rng``."""
    temperatures, seeds, params = [], [], []
    plain = True
    suppressed = penalty_tokens = None
    grammar_rows = []
    for i, seq in enumerate(seqs):
        sp = seq.sampling_params
        params.append(sp)
        temperatures.append(0.0 if sp.is_greedy else sp.temperature)
        step = seq.num_completion_tokens
        seeds.append(rng.getrandbits(32) if sp.seed is None else draw_seed(sp.seed, step))
        if step < sp.min_tokens and seq.min_tokens_ids:
            suppressed = suppressed or [[] for _ in seqs]
            suppressed[i] = seq.min_tokens_ids
        if sp.has_penalties:
            penalty_tokens = penalty_tokens or [None] * len(seqs)
            penalty_tokens[i] = (seq.prompt_token_ids, seq.completion_token_ids)
        if plain and (
            sp.has_filters or sp.has_penalties or sp.logprobs is not None or step < sp.min_tokens
        ):
            plain = False
        # a prompt chunk that is not the last samples nothing: its grammar has no row this step
        if (
            seq.grammar is not None
            and seq.num_cached_tokens + seq.num_scheduled_tokens >= seq.num_tokens
        ):
            grammar_rows.append(i)
    token_bitmask = grammar_bitmask(seqs, grammar_rows) if grammar_rows else None
    plain = plain and token_bitmask is None
    return SamplingRows(
        temperatures, seeds, params, plain, suppressed, penalty_tokens, token_bitmask
    )


def grammar_bitmask(seqs: list[Sequence], rows: list[int]) -> tuple[list[int], np.ndarray]:
    """The tokens each of ``rows`` (sequences with a grammar that sample this step) may sample next
    (``SamplingRows.token_bitmask``). Its matcher has taken every earlier token: the core resolves
    a step with grammar rows before it schedules the next one."""
    bitmask = np.empty((len(rows), seqs[rows[0]].grammar.bitmask_width), dtype=np.int32)
    for j, i in enumerate(rows):
        seqs[i].grammar.fill_bitmask(bitmask, j)
    return rows, bitmask
