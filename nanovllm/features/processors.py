"""Per-request processors: what a request needs beyond a temperature and a seed.

``attach_processors`` picks a sequence's processors once, when its request is queued; the core
and the sampler then call them without knowing which exist. A plain request gets none, and its
steps carry only temperatures and draw seeds.
"""

from dataclasses import dataclass, field


@dataclass
class RowExtras:
    """A step's sampling settings beyond temperatures and seeds, one entry per row (None: the row
    has none of that kind; a list is None when no row has any). Plain data: it goes to rank 0."""

    num_rows: int
    suppressed: list | None = None  # token ids masked to -inf
    penalties: list | None = None  # (repetition, presence, frequency, prompt ids, output ids)
    filters: list | None = None  # (top_k, top_p, min_p)
    logprobs: list | None = None  # top tokens to return
    bitmask_rows: list[int] = field(default_factory=list)  # rows a grammar constrains
    bitmasks: list = field(default_factory=list)  # their [1, words] int32 token bitmasks
    sync: bool = False  # the next step's rows need this step's tokens on the host

    def set(self, kind: str, row: int, value) -> None:
        values = getattr(self, kind)
        if values is None:
            values = [None] * self.num_rows
            setattr(self, kind, values)
        values[row] = value


def row_extras(step) -> RowExtras:
    """The step's ``RowExtras``, made by the first processor that contributes."""
    rows = step.sampling
    if rows.extra is None:
        rows.extra = RowExtras(len(rows.temperatures))
    return rows.extra


class RequestProcessor:
    """One sequence's hooks; each does nothing unless a processor overrides it."""

    def contribute(self, step, row: int, seq, offset: int) -> None:
        """Add to ``step`` (built for ``seq`` at ``row``; its tokens start at ``offset``)."""

    def take(self, seq, extra: dict) -> None:
        """The row's extra outputs of a resolved step (before its token is set)."""

    def accept(self, seq, token_id: int) -> bool:
        """The sampled token, just set; True ends the sequence with "stop"."""
        return False

    def report(self, seq, out, extra: dict | None) -> None:
        """Add to the ``SeqOutput`` the core reports for ``seq``."""


def attach_processors(seqs: list, eos_token_ids: list[int], core=None) -> None:
    """Give each of a request's sequences the processors its ``SamplingParams`` ask for (``core``:
    the engine core, whose tokenizer a grammar needs). Completion 0 scores the prompt."""
    from nanovllm.features import logits_processors as lp

    for i, seq in enumerate(seqs):
        sp, procs = seq.sampling_params, []
        stop_ids = list(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop_ids += [e for e in eos_token_ids if e not in sp.stop_token_ids]
        if sp.min_tokens and stop_ids:
            procs.append(lp.MinTokens(sp.min_tokens, stop_ids))
        if sp.has_penalties:
            procs.append(lp.Penalties(sp))
        if sp.has_filters:
            procs.append(lp.Filters(sp))
        if sp.logprobs is not None:
            procs.append(lp.Logprobs(sp.logprobs))
        if sp.structured_outputs is not None:
            from nanovllm.features.structured_outputs.processor import grammar_processor

            procs.append(grammar_processor(core, sp.structured_outputs))
        if i == 0 and sp.prompt_logprobs is not None:
            from nanovllm.features.prompt_logprobs import PromptLogprobs

            procs.append(PromptLogprobs(seq, sp.prompt_logprobs))
        seq.processors = procs
