"""The plain description of one step sent to every rank (no ``Sequence`` crosses)."""

from dataclasses import dataclass, replace
from itertools import chain
from random import Random

from nanovllm.engine.sequence import Sequence

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, step: int) -> int:
    x = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & 0xFFFFFFFF


@dataclass
class SamplingRows:
    """Rows' temperature (0: greedy) and seed; ``extra`` (rank 0): request processors' part."""

    temperatures: list[float]
    seeds: list[int]
    extra: object | None = None

    @property
    def plain(self) -> bool:
        return self.extra is None


@dataclass
class Step:
    """Sequence ``i`` has ``num_computed[i]`` tokens cached and computes ``num_new[i]`` more; an
    unknown token is -1, in row ``prev_rows[i]`` of the previous step's samples."""

    is_prefill: bool
    token_ids: list[int]
    num_computed: list[int]
    num_new: list[int]
    block_tables: list[list[int]]
    prev_rows: list[int] | None = None
    sampling: SamplingRows | None = None
    prompt_scoring: object | None = None  # prompt tokens every rank scores
    adapters: list[int] | None = None  # each sequence's LoRA slot (-1: none; lora/runner.py)
    state_slots: list[int] | None = None  # hybrid models: each sequence's recurrent-state slot

    @property
    def num_seqs(self) -> int:
        return len(self.num_new)

    def for_workers(self) -> "Step":  # ranks other than 0 need only a plain step's rows
        rows = self.sampling
        return self if rows is None or rows.plain else replace(self, sampling=None)


def build_step(seqs: list[Sequence], is_prefill: bool, rng: Random) -> Step:
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
    rows = sampling_rows(seqs, rng)
    tables = [s.block_table for s in seqs]
    step = Step(is_prefill, token_ids, num_computed, num_new, tables, prev_rows, rows)
    if seqs[0].state_slot >= 0:
        step.state_slots = [seq.state_slot for seq in seqs]
    for i, seq in enumerate(seqs):
        if seq.processors:
            offset = sum(num_new[:i]) if is_prefill else i  # its first token among the step's
            for p in seq.processors:
                p.contribute(step, i, seq, offset)
    return step


def sampling_rows(seqs: list[Sequence], rng: Random) -> SamplingRows:
    temperatures, seeds = [], []
    for seq in seqs:
        sp = seq.sampling_params
        temperatures.append(0.0 if sp.is_greedy else sp.temperature)
        step = seq.num_completion_tokens
        seeds.append(rng.getrandbits(32) if sp.seed is None else draw_seed(sp.seed, step))
    return SamplingRows(temperatures, seeds)
