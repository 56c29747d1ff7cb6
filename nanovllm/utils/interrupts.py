"""Ctrl-C between engine steps, not inside one (docs/frontend.md)."""

import signal
import threading
from contextlib import contextmanager


@contextmanager
def deferred_interrupt():
    """Hold back SIGINT until the block ends, then raise KeyboardInterrupt; a second Ctrl-C
    interrupts at once. Only in the main thread, with Python's own handler installed."""
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
