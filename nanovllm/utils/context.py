"""Per-step attention metadata, set by the model runner around one forward pass."""

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Context:
    """Prefill: ``cu_seqlens_q/k`` and maxima, ``block_tables`` with a cached prefix. Decode:
    ``context_lens``, ``block_tables``. Both: ``slot_mapping`` (-1: skip)."""

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


@contextmanager
def step_context(context: Context):
    global _CONTEXT
    _CONTEXT = context
    try:
        yield context
    finally:
        _CONTEXT = Context()
