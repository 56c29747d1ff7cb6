"""Calls that other processes take part in must not stop half-way: ``shielded`` holds Ctrl-C
back for the length of one such call, however often it is pressed."""

import signal
import threading
from contextlib import contextmanager


@contextmanager
def shielded():
    """Hold back SIGINT until the block ends, then hand each press to the handler that was
    installed (Python's raises KeyboardInterrupt). Only in the main thread, and only while a Python
    handler is installed."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    presses = []
    signal.signal(signal.SIGINT, lambda signum, frame: presses.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        for signum in presses:
            previous(signum, None)
