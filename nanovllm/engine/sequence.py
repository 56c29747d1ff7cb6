"""One completion as the scheduler sees it: its token ids, where its KV lives, how far it has been
computed (pure Python). Its text, log-probabilities and result dict are the front end's
(``output_processor.py``)."""

from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams

PLACEHOLDER = -1  # a sampled token whose value the host learns one step later


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A completion's token ids plus its paged-KV bookkeeping.

    Invariant: the KV of ``token_ids[:num_cached_tokens]`` is stored in the cache blocks of
    ``block_table``; a step computes the next ``num_scheduled_tokens`` of them. The last
    ``num_pending`` tokens are placeholders: sampled on the device by a step still in flight, their
    values come when that step is resolved (the newest one's is row ``pending_row`` of its output).
    A finished sequence has no placeholders: it finishes when the value that ends it is known, and
    tokens computed past that are dropped.
    """

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
        self.request_id = (
            self.seq_id if request_id is None else request_id
        )  # n > 1: the first completion's id
        self.status = SequenceStatus.WAITING
        self.block_size = block_size
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_pending = 0
        self.pending_row = -1
        self.num_prefix_hit_tokens = (
            -1
        )  # prompt tokens served by the prefix cache at first admission
        self.block_table: list[int] = []
        self.sampling_params = sampling_params
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.min_tokens = sampling_params.min_tokens
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.min_tokens_ids = list(
            sampling_params.stop_token_ids
        )  # suppressed before min_tokens; the core adds EOS
        # n > 1: the first completion of the request; this one is admitted once that one's prompt
        # is computed, so the prompt's full blocks come from the prefix cache
        self.wait_for: Sequence | None = None
        self.finish_reason: str | None = None  # "stop", "length" or "abort" once finished
        self.stop_reason: int | None = None  # the stop token id that ended it
        self.num_reported = 0  # completion tokens the core has handed to the front end
        # prompt_logprobs (completion 0 of a request that asks): an entry per prompt token scored so
        # far, None for the first; handed to the front end once, with the sequence's first report
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        # structured outputs: the matcher of its grammar (``structured_outputs.grammar.SequenceGrammar``,
        # set by the core), which has taken every known completion token
        self.grammar = None

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host has (all but the pending placeholders)."""
        return self.num_tokens - self.num_pending

    @property
    def scores_prompt(self) -> bool:
        """Whether it still owes prompt log-probabilities: then it computes its whole prompt (it
        takes no prefix-cache hits), and each prefill chunk scores the prompt tokens after it."""
        return (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block index {i} out of range for {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.append_placeholder(-1)
        self.set_token(self.num_tokens - 1, token_id)

    def append_placeholder(self, row: int) -> None:
        """A token sampled in row ``row`` of a step in flight; its value comes with ``set_token``."""
        self.token_ids.append(PLACEHOLDER)
        self.last_token = PLACEHOLDER
        self.num_tokens += 1
        self.num_pending += 1
        self.pending_row = row

    def set_token(self, position: int, token_id: int) -> None:
        """The value of the oldest pending placeholder, at ``position``."""
        if position != self.num_known_tokens:
            raise ValueError(
                f"sequence {self.seq_id}: token {position} set out of order (next is {self.num_known_tokens})"
            )
        self.token_ids[position] = token_id
        self.num_pending -= 1
        if position == self.num_tokens - 1:
            self.last_token = token_id
            self.pending_row = -1

    def discard_pending(self) -> None:
        """Drop the placeholders (tokens computed past the end of a finished sequence)."""
        if self.num_pending:
            del self.token_ids[self.num_known_tokens :]
            self.num_tokens -= self.num_pending
            self.num_pending = 0
            self.pending_row = -1
            self.last_token = self.token_ids[-1]

    def scheduled_token_ids(self) -> list[int]:
        """The tokens this step computes (after the cached prefix)."""
        start = self.num_cached_tokens
        return self.token_ids[start : start + self.num_scheduled_tokens]


def request_sequences(
    request_id: int,
    prompt_token_ids: list[int],
    sampling_params: SamplingParams,
    block_size: int,
    eos_token_ids: list[int],
) -> list["Sequence"]:
    """A request's ``n`` completions as sequences ``request_id + i``. EOS (unless ``ignore_eos``)
    joins the ids suppressed before ``min_tokens``. Completion 0 is computed first; the others are
    admitted once its prompt is in the cache, so they share the prompt's full blocks. Completion 0
    scores the prompt when the request asks for ``prompt_logprobs``."""
    sp = sampling_params
    suppressed = [] if sp.ignore_eos else [e for e in eos_token_ids if e not in sp.stop_token_ids]
    seqs = []
    for i in range(sp.n):
        seq = Sequence(
            prompt_token_ids,
            sp.for_completion(i) if sp.n > 1 else sp,
            block_size,
            seq_id=request_id + i,
            request_id=request_id,
        )
        seq.min_tokens_ids += suppressed
        if i == 0 and sp.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        if i and len(prompt_token_ids) > block_size:
            seq.wait_for = seqs[0]
        seqs.append(seq)
    return seqs
