"""Rank 0's calls to the tensor-parallel workers: ``[method_name, *args]`` pickled into a POSIX
shared-memory segment (4-byte little-endian length, then the bytes) under a name unique to the
engine, and one ``multiprocessing.Event`` per worker. Tensors never travel here: collectives carry
them. A step travels as its plain description (``step.Step``)."""

import multiprocessing as mp
import pickle
import time
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory

MIN_BYTES = 1 << 20


def channel_bytes(config) -> int:
    """Room for the largest step message: every scheduled token and block-table entry at their
    pickled worst case (5 bytes), plus per-sequence overhead; at least 1 MiB."""
    max_blocks = -(-config.max_model_len // config.kvcache_block_size)
    worst = config.max_num_batched_tokens * 5 + config.max_num_seqs * (max_blocks * 5 + 512)
    return max(MIN_BYTES, worst + (64 << 10))


class ControlChannel:
    """Rank 0 ``create``s the channel and ``write``s; each worker ``attach``es and ``read``s."""

    def __init__(self, shm: SharedMemory, owner: bool):
        self.shm, self.owner = shm, owner
        self.events = []  # rank 0: one per worker; a worker: its own
        self.failure: Callable[[], str | None] = lambda: (
            None
        )  # rank 0: which worker has died, if any

    @classmethod
    def create(cls, name: str, size: int) -> "ControlChannel":
        return cls(SharedMemory(name=name, create=True, size=size), owner=True)

    @classmethod
    def attach(cls, name: str, event) -> "ControlChannel":
        channel = cls(SharedMemory(name=name), owner=False)
        channel.events = [event]
        return channel

    def write(self, method_name: str, *args) -> None:
        """Send one call to the workers, once each has taken the previous one: rank 0 may run a step
        ahead of them (its collectives return before the workers join them on a GPU)."""
        for event in self.events:
            while event.is_set():
                if failure := self.failure():
                    raise RuntimeError(failure)
                time.sleep(0)
        data = pickle.dumps([method_name, *args])
        n = len(data)
        if n + 4 > self.shm.size:
            raise ValueError(
                f"control message for {method_name!r} is {n} bytes, more than the {self.shm.size - 4}-byte channel"
            )
        self.shm.buf[0:4] = n.to_bytes(4, "little")
        self.shm.buf[4 : n + 4] = data
        for event in self.events:
            event.set()

    def read(self) -> tuple[str, list]:
        """The next call (a worker): waits for its event, leaving if the engine's process is gone."""
        event = self.events[0]
        parent = mp.parent_process()
        while not event.wait(1.0):
            if parent is not None and not parent.is_alive():  # nobody will call
                raise SystemExit(1)
        n = int.from_bytes(self.shm.buf[0:4], "little")
        method_name, *args = pickle.loads(self.shm.buf[4 : n + 4])
        event.clear()
        return method_name, args

    def close(self) -> None:
        if self.shm is None:
            return
        self.shm.close()
        if self.owner:
            self.shm.unlink()
        self.shm = None
