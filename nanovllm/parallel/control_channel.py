"""Rank 0's calls to the tensor-parallel workers: ``[method_name, *args]`` pickled into a POSIX
shared-memory segment (4-byte little-endian length, then the bytes) under a name unique to the
engine, and one pipe per worker to say "a call is there" and, back, "taken". Tensors never travel
here (collectives carry them); a step travels as its plain description (``step.Step``)."""

import os
import pickle
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

MIN_BYTES = 1 << 20
GO, TAKEN = b"g", b"t"


def channel_bytes(config) -> int:
    """Room for the largest step message: every scheduled token and block-table entry at their
    pickled worst case (5 bytes), plus per-sequence overhead; at least 1 MiB."""
    max_blocks = -(-config.max_model_len // config.kvcache_block_size)
    worst = config.max_num_batched_tokens * 5 + config.max_num_seqs * (max_blocks * 5 + 512)
    return max(MIN_BYTES, worst + (64 << 10))


def channel_name() -> str:
    """A name unique to this engine: ``nanovllm-<pid of rank 0>-<random>``."""
    return f"nanovllm-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def release_channels(pid: int) -> None:
    """Unlink the channels of rank 0 process ``pid``, which died without doing it (Linux)."""
    prefix = f"nanovllm-{pid}-"
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    for name in names:
        if name.startswith(prefix):
            try:
                shm = SharedMemory(name=name)
            except FileNotFoundError:
                continue
            shm.close()
            shm.unlink()


class ControlChannel:
    """Rank 0 ``create``s the channel and ``write``s; each worker ``attach``es and ``read``s."""

    def __init__(self, shm: SharedMemory, owner: bool):
        self.shm, self.owner = shm, owner
        self.conns: list[Connection] = []  # rank 0: one per worker; a worker: its own
        self.pending: list[bool] = []  # rank 0: a worker has not taken the last call yet
        self.failure: Callable[[], str | None] = lambda: None  # rank 0: which worker died, if any

    @classmethod
    def create(cls, name: str, size: int) -> "ControlChannel":
        return cls(SharedMemory(name=name, create=True, size=size), owner=True)

    @classmethod
    def attach(cls, name: str, conn: Connection) -> "ControlChannel":
        channel = cls(SharedMemory(name=name), owner=False)
        channel.conns = [conn]
        return channel

    def write(self, method_name: str, *args) -> None:
        """Send one call to the workers once each has taken the previous one (rank 0 may run a
        step ahead of them). A dead worker is a RuntimeError naming it, never a hang."""
        data = pickle.dumps([method_name, *args])
        n = len(data)
        if n + 4 > self.shm.size:
            raise ValueError(
                f"control message for {method_name!r} is {n} bytes, "
                f"more than the {self.shm.size - 4}-byte channel"
            )
        if len(self.pending) != len(self.conns):
            self.pending = [False] * len(self.conns)
        for i, conn in enumerate(self.conns):
            if self.pending[i]:
                self._taken(conn)
                self.pending[i] = False
        self.shm.buf[0:4] = n.to_bytes(4, "little")
        self.shm.buf[4 : n + 4] = data
        for i, conn in enumerate(self.conns):
            try:
                conn.send_bytes(GO)
            except OSError as e:  # the worker's end is closed: it died
                raise RuntimeError(self.failure() or "a tensor-parallel worker is gone") from e
            self.pending[i] = True

    def _taken(self, conn: Connection) -> None:
        while not conn.poll(0.05):
            if failure := self.failure():
                raise RuntimeError(failure)
        try:
            conn.recv_bytes()
        except (EOFError, OSError) as e:
            raise RuntimeError(self.failure() or "a tensor-parallel worker is gone") from e

    def read(self) -> tuple[str, list]:
        """The next call (a worker); leaves (SystemExit) when rank 0 is gone."""
        conn = self.conns[0]
        try:
            conn.recv_bytes()
        except (EOFError, OSError):  # rank 0's end closed: nobody will call
            raise SystemExit(1) from None
        n = int.from_bytes(self.shm.buf[0:4], "little")
        method_name, *args = pickle.loads(self.shm.buf[4 : n + 4])
        conn.send_bytes(TAKEN)
        return method_name, args

    def close(self) -> None:
        if self.shm is None:
            return
        self.shm.close()
        if self.owner:
            self.shm.unlink()
        self.shm = None
