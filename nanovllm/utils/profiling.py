"""Named phases of the engine's work, for measuring tools.

The engine wraps each phase of a step in ``phase(name)``; by default that costs one global read
and returns a shared no-op context. A tool installs a hook, a function of the phase's name that
returns a context manager (``torch.profiler.record_function`` for a trace, a timer for host
time), for as long as it measures:

    with phase_hook(lambda name: record_function("@" + name)):
        llm.generate(...)

Phases (nested where the engine nests them):
    schedule  the scheduler picks the step's sequences and builds the step description
    inputs    the model runner turns the step into tensors (inputs, attention context, sampling)
    forward   the model's forward pass, or a CUDA graph's replay
    sample    the sampler (not when a CUDA graph draws)
    wait      the host waits for a step's sampled token ids
    update    the engine core appends the tokens and finishes sequences
    outputs   the front end: text, stop strings, stream increments and result dicts
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

PHASES = ("schedule", "inputs", "forward", "sample", "wait", "update", "outputs")

_NOOP = nullcontext()
_hook: Callable[[str], AbstractContextManager] | None = None


def phase(name: str) -> AbstractContextManager:
    """The context of one phase: the installed hook's, or a no-op."""
    return _NOOP if _hook is None else _hook(name)


@contextmanager
def phase_hook(hook: Callable[[str], AbstractContextManager]) -> Iterator[None]:
    """Install ``hook`` for the duration of the block (in this process; worker ranks are not hooked)."""
    global _hook
    previous, _hook = _hook, hook
    try:
        yield
    finally:
        _hook = previous
