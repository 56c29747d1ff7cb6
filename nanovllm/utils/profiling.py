"""Named phases for measuring tools: ``phase(name)`` is a no-op unless a hook is installed."""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

PHASES = ("schedule", "inputs", "forward", "sample", "wait", "update", "outputs")

_NOOP = nullcontext()
_hook: Callable[[str], AbstractContextManager] | None = None


def phase(name: str) -> AbstractContextManager:
    return _NOOP if _hook is None else _hook(name)


@contextmanager
def phase_hook(hook: Callable[[str], AbstractContextManager]) -> Iterator[None]:
    global _hook
    previous, _hook = _hook, hook
    try:
        yield
    finally:
        _hook = previous
