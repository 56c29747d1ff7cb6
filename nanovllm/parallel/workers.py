"""The worker processes of tensor parallelism: ranks 1..N-1, each running its ModelRunner on the
calls rank 0 sends through the control channel."""

import os
import signal
import threading
import time
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.parallel.control_channel import ControlChannel
from nanovllm.parallel.distributed import abort_custom_all_reduce
from nanovllm.runner.model_runner import ModelRunner


def _worker_main(config: Config, rank: int, dist_port: int, channel_name: str, event) -> None:
    # a terminal's Ctrl-C reaches every process of its group: rank 0 alone decides what it means
    # (its call's requests end between steps) and tells the workers through the channel
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    event.set()  # started: the engine may now join the process group
    runner = ModelRunner(config, rank, dist_port)
    channel = ControlChannel.attach(channel_name, event)
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
    """Spawns ranks 1..N-1 and watches them: a worker that dies makes ``failure()`` say so, and a
    watchdog thread keeps the engine's signal to a dead worker from blocking (see ``_watch``)."""

    def __init__(self, config: Config, dist_port: int, channel_name: str):
        # NCCL's own error handling would tear the process down on the abort that turns a dead
        # worker into an exception (see ModelRunner.release); the user's choice wins if set
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        ctx = mp.get_context("spawn")
        self.processes = []
        self.events = []
        self.closing = False
        self._watchdog = None
        for rank in range(1, config.tensor_parallel_size):
            event = ctx.Event()
            process = ctx.Process(
                target=_worker_main,
                args=(config, rank, dist_port, channel_name, event),
                name=f"nanovllm-rank{rank}",
                daemon=True,
            )
            process.start()
            self.processes.append(process)
            self.events.append(event)
        try:
            for event in self.events:  # each worker signals once it runs, before joining the group
                while not event.wait(0.2):
                    if failure := self.failure():
                        raise RuntimeError(f"{failure} while starting")
                event.clear()
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="nanovllm-watchdog", daemon=True)
        self._watchdog.start()

    def failure(self) -> str | None:
        """Which worker has exited, if any."""
        for rank, p in enumerate(self.processes, 1):
            if p.exitcode is not None:
                return f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def wait_failure(self, timeout: float) -> str | None:
        """After a collective failed: wait briefly for a worker's death to become visible."""
        ready = wait([p.sentinel for p in self.processes], timeout)
        for p in self.processes:
            if p.sentinel in ready:
                p.join(1.0)  # the sentinel fires a moment before the exit status can be read
        return self.failure()

    def _watch(self) -> None:
        """A worker killed while it waited on its event leaves ``Event.set()`` (in the engine)
        waiting for it to wake up, forever: the event's condition counts it as a sleeper. Once
        that wake-up is pending (its wait semaphore is up and nobody will take it), acknowledge
        it on the dead worker's behalf; ``set()`` then returns and the engine sees the failure.
        First, the one-shot all-reduce of this rank is told to stop waiting on its peers."""
        sentinels = [p.sentinel for p in self.processes]
        wait(sentinels)
        if (
            not self.closing
        ):  # a worker died: free this rank's one-shot all-reduce waits on it at once
            abort_custom_all_reduce()
        pending = [False] * len(self.processes)
        while not self.closing:
            dead = wait(sentinels, 0)  # not p.exitcode: reaping here would race failure()
            for i, (sentinel, event) in enumerate(zip(sentinels, self.events)):
                cond = event._cond
                woken = cond._wait_semaphore.get_value() > 0
                if sentinel in dead and woken and not pending[i]:
                    cond._woken_count.release()
                pending[i] = woken  # acknowledged once until set() clears the semaphore
            time.sleep(0.01)

    def close(self, timeout: float = 30.0) -> None:
        """Wait for the workers to leave (after an ``exit`` call), killing any that do not."""
        self.closing = True
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        if self._watchdog is not None:
            self._watchdog.join()  # it holds the events too
        self.events = []  # their named semaphores in /dev/shm go with them
