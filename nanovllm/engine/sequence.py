"""One completion as the scheduler sees it."""

from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams

PLACEHOLDER = -1  # a sampled token whose value the host learns one step later


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Invariant: the KV of ``token_ids[:num_cached_tokens]`` is in ``block_table``'s blocks; the
    last ``num_pending`` tokens are placeholders of steps in flight (none once finished)."""

    _ids = count()

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams,
        block_size: int,
        seq_id: int | None = None,
        request_id: int | None = None,
    ):
        self.seq_id = next(Sequence._ids) if seq_id is None else seq_id
        self.request_id = self.seq_id if request_id is None else request_id  # n > 1: completion 0's
        self.status = SequenceStatus.WAITING
        self.block_size = block_size
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1]
        self.num_tokens = self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = self.num_scheduled_tokens = self.num_pending = 0
        self.pending_row = -1
        self.num_prefix_hit_tokens = -1  # prompt tokens the prefix cache served at first admission
        self.block_table: list[int] = []
        self.sampling_params = sp = sampling_params
        self.max_tokens, self.min_tokens = sp.max_tokens, sp.min_tokens
        self.ignore_eos = sp.ignore_eos
        self.stop_token_ids = frozenset(sp.stop_token_ids)
        self.wait_for: Sequence | None = None  # n > 1: completion 0, whose prompt blocks it shares
        self.finish_reason: str | None = None  # "stop", "length" or "abort" once finished
        self.stop_reason: int | None = None  # the stop token id that ended it
        self.num_reported = 0  # completion tokens the core has handed to the front end
        self.processors: list = []  # its request processors (features.processors)
        self.uses_prefix_cache = True  # False: it computes its whole prompt
        self.cache_salt = -1  # its prefix-cache hashes start from this (an adapter's: lora/)
        self.state_slot = -1  # hybrid models: where its recurrent states live (block manager)

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:  # all but the pending placeholders
        return self.num_tokens - self.num_pending

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block {i} out of range for {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_placeholder(self, row: int) -> None:
        self.token_ids.append(PLACEHOLDER)
        self.last_token = PLACEHOLDER
        self.num_tokens += 1
        self.num_pending += 1
        self.pending_row = row

    def set_token(self, position: int, token_id: int) -> None:
        if position != self.num_known_tokens:
            msg = f"set out of order (next is {self.num_known_tokens})"
            raise ValueError(f"sequence {self.seq_id}: token {position} {msg}")
        self.token_ids[position] = token_id
        self.num_pending -= 1
        if position == self.num_tokens - 1:
            self.last_token = token_id
            self.pending_row = -1

    def discard_pending(self) -> None:
        """Drop the placeholders (tokens past the end)."""
        if self.num_pending:
            del self.token_ids[self.num_known_tokens :]
            self.num_tokens -= self.num_pending
            self.num_pending = 0
            self.pending_row = -1
            self.last_token = self.token_ids[-1]

    def scheduled_token_ids(self) -> list[int]:
        start = self.num_cached_tokens
        return self.token_ids[start : start + self.num_scheduled_tokens]


def request_sequences(
    request_id: int, prompt_token_ids: list[int], sampling_params: SamplingParams, block_size: int
) -> list[Sequence]:
    """Completions ``request_id + i``; the others wait for completion 0's prompt blocks."""
    sp = sampling_params
    seqs = []
    for i in range(sp.n):
        params = sp.for_completion(i) if sp.n > 1 else sp
        seq = Sequence(prompt_token_ids, params, block_size, request_id + i, request_id)
        if i and len(prompt_token_ids) > block_size:
            seq.wait_for = seqs[0]
        seqs.append(seq)
    return seqs
