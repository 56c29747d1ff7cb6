"""Ctrl-C between engine steps, not inside one (docs/frontend.md)."""

import signal
import threading
from contextlib import contextmanager


@contextmanager
def deferred_interrupt():
    """SIGINT waits for the block's end (a second one interrupts at once); main thread only."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received = []

    def hold(signum, frame):
        if received:
            signal.default_int_handler(signum, frame)
        received.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt
