"""Rank 0's calls to the tensor-parallel workers (docs/parallel.md)."""

import os
import pickle
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

MIN_BYTES = 1 << 20
GO, TAKEN = b"g", b"t"


def channel_bytes(config) -> int:
    # every scheduled token and block-table entry at their pickled worst case (5 bytes)
    max_blocks = -(-config.max_model_len // config.kvcache_block_size)
    worst = config.max_num_batched_tokens * 5 + config.max_num_seqs * (max_blocks * 5 + 512)
    return max(MIN_BYTES, worst + (64 << 10))


def channel_name() -> str:
    return f"nanovllm-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def release_channels(pid: int) -> None:
    """Unlink the channels a dead rank 0 ``pid`` left behind."""
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
    """Rank 0 creates it and writes; each worker attaches and reads."""

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
        """Send once each worker took the last call; a dead worker raises, never hangs."""
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
        """The next call; SystemExit when rank 0 is gone."""
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
