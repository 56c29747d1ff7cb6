"""The step's sequences as the linear-attention layers see them, set by the runner around a
forward pass (as ``utils/context`` is for attention)."""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class StateBatch:
    """Sequence ``i`` has tokens ``starts[i] : starts[i] + lens[i]`` of the step, its recurrent
    states in slot ``slots[i]``; ``fresh[i]``: its first tokens (its states start at zero).

    On a GPU also ``tensors`` [4, N] int32 (rows: starts, lens, slots, fresh; a captured decode
    graph's hold its padded rows, the host lists are then empty), ``max_len`` (>= every length),
    and for a prefill step ``cu_seqlens`` (int64, device and host)."""

    starts: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    fresh: list[bool] = field(default_factory=list)
    tensors: torch.Tensor | None = None
    max_len: int = 0
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None


_BATCH = StateBatch()


def get_state_batch() -> StateBatch:
    return _BATCH


@contextmanager
def state_batch(batch: StateBatch):
    global _BATCH
    _BATCH = batch
    try:
        yield batch
    finally:
        _BATCH = StateBatch()
