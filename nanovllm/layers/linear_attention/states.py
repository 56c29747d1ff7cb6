"""The step's sequences as the linear-attention layers see them, set by the runner around a
forward pass (as ``utils/context`` is for attention)."""

from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StateBatch:
    """Sequence ``i`` has tokens ``starts[i] : starts[i] + lens[i]`` of the step, its recurrent
    states in slot ``slots[i]``; ``fresh[i]``: its first tokens (its states start at zero)."""

    starts: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    fresh: list[bool] = field(default_factory=list)


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
