"""Ctrl-C between engine steps, not inside one: a step stopped half-way would leave its sequences
scheduled but not computed (and tensor-parallel ranks out of step)."""

import signal
import threading
from contextlib import contextmanager


@contextmanager
def deferred_interrupt():
    """Hold back SIGINT until the block ends, then raise KeyboardInterrupt; a second Ctrl-C
    interrupts at once. Only in the main thread, with Python's own handler installed."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
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
