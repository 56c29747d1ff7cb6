"""Tensor-parallel ranks 1..N-1, each running rank 0's calls on its ModelRunner."""

import os
import signal
import threading
from multiprocessing.connection import Connection, wait

import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.parallel.control_channel import ControlChannel
from nanovllm.parallel.group import abort_custom_all_reduce
from nanovllm.runner.model_runner import ModelRunner

STARTED = b"s"


def _worker_main(config: Config, rank: int, dist_port: int, name: str, conn: Connection) -> None:
    # a terminal's Ctrl-C reaches every process of its group: rank 0 alone decides what it means
    # (its call's requests end between steps) and tells the workers through the channel
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send_bytes(STARTED)  # the engine may now join the process group
    runner = ModelRunner(config, rank, dist_port)
    channel = ControlChannel.attach(name, conn)
    try:
        while True:
            method_name, args = channel.read()
            if method_name == "exit":
                runner.exit()
                break
            getattr(runner, method_name)(*args)
    finally:
        channel.close()


class WorkerGroup:
    """Ranks 1..N-1, each with a pipe to rank 0; a watchdog frees the one-shot all-reduce's waits
    once one exits."""

    def __init__(self, config: Config, dist_port: int, channel_name: str):
        # NCCL's own error handling would tear the process down on the abort that turns a dead
        # worker into an exception (see ModelRunner.release); the user's choice wins if set
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        ctx = mp.get_context("spawn")
        self.processes, self.conns = [], []
        self.closing = False
        self._watchdog = None
        try:
            for rank in range(1, config.tensor_parallel_size):
                conn, child = ctx.Pipe()
                process = ctx.Process(
                    target=_worker_main,
                    args=(config, rank, dist_port, channel_name, child),
                    name=f"nanovllm-rank{rank}",
                    daemon=True,
                )
                process.start()
                child.close()  # the worker's end is its own: its death reads as the pipe's end
                self.processes.append(process)
                self.conns.append(conn)
            for conn in self.conns:  # each worker says it runs, before joining the group
                while not conn.poll(0.2):
                    if failure := self.failure():
                        raise RuntimeError(f"{failure} while starting")
                if conn.recv_bytes() != STARTED:
                    raise RuntimeError("a tensor-parallel worker sent an unexpected message")
        except BaseException as e:
            if isinstance(e, EOFError):
                e = RuntimeError(f"{self.wait_failure(2.0)} while starting")
            self.close()
            raise e
        self._watchdog = threading.Thread(target=self._watch, name="nanovllm-watchdog", daemon=True)
        self._watchdog.start()

    def failure(self) -> str | None:
        for rank, p in enumerate(self.processes, 1):
            if p.exitcode is not None:
                code = p.exitcode
                return f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {code}"
        return None

    def wait_failure(self, timeout: float) -> str | None:
        # after a collective failed: a worker's death takes a moment to become visible
        ready = wait([p.sentinel for p in self.processes], timeout)
        for p in self.processes:
            if p.sentinel in ready:
                p.join(1.0)  # the sentinel fires a moment before the exit status can be read
        return self.failure()

    def _watch(self) -> None:
        wait([p.sentinel for p in self.processes])
        if not self.closing:  # a worker died: its peers' one-shot all-reduce waits end now
            abort_custom_all_reduce()

    def close(self, timeout: float = 30.0) -> None:
        self.closing = True
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        if self._watchdog is not None:
            self._watchdog.join()
        for conn in self.conns:
            conn.close()
        self.conns = []
