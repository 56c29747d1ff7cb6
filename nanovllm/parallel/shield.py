import signal
import threading
from contextlib import contextmanager


@contextmanager
def shielded():
    """Defer each Ctrl-C to the end of the block."""
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
