"""Per-step attention metadata, set by the model runner around one forward pass."""

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Context:
    """What the attention layers need to know about the current step.

    Prefill: ``cu_seqlens_q``/``cu_seqlens_k`` are cumulative new-token and total-token counts
    per sequence, ``max_seqlen_q``/``max_seqlen_k`` their maxima; ``block_tables`` is set when any
    sequence has a cached prefix (its keys are then read from the paged cache).
    Decode: ``context_lens`` (tokens per sequence, the new one included) and ``block_tables``.
    Both: ``slot_mapping`` gives each new token's cache slot (block id * block size + offset; -1 skips).
    """

    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(context: Context) -> None:
    global _CONTEXT
    _CONTEXT = context


def reset_context() -> None:
    set_context(Context())


@contextmanager
def step_context(context: Context):
    """Make ``context`` current for one forward pass and always reset it afterwards."""
    set_context(context)
    try:
        yield context
    finally:
        reset_context()
