"""Tensor parallelism: rank 0 here, the other ranks in workers (docs/parallel.md)."""

import socket
import traceback

from nanovllm.config import Config
from nanovllm.engine.step import Step
from nanovllm.parallel.control_channel import ControlChannel, channel_bytes, channel_name
from nanovllm.parallel.shield import shielded
from nanovllm.parallel.workers import WorkerGroup
from nanovllm.runner.model_runner import ModelRunner, RankZeroOnly, check_parallel


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    def __init__(self, config: Config):
        check_parallel()
        self.failure_message: str | None = None
        self.runner = self.workers = self.channel = None
        port = _free_port()
        name = channel_name()
        self.channel = ControlChannel.create(name, channel_bytes(config))
        try:
            self.workers = WorkerGroup(config, port, name)
        except BaseException:
            self.channel.close()
            raise
        self.channel.conns = self.workers.conns
        self.channel.failure = self.workers.failure
        try:
            self.runner = ModelRunner(config, 0, port, self.workers.failure)
        except BaseException as e:  # the runner has released what it held
            failure = self.workers.wait_failure(2.0) if self.workers else None
            self._close_workers(timeout=1.0)
            if failure:
                raise RuntimeError(f"{failure} while the engine was starting") from e
            raise
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks

    def run(self, step: Step):

        def launch():
            if self.channel is not None:
                self.channel.write("run", step.for_workers())
            return self.runner.run(step)

        return self._guarded(launch)

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """``[rank 0's result]``; ``RankZeroOnly`` arguments stay on rank 0."""
        kwargs = kwargs or {}

        def call():
            if self.channel is not None:
                sent = tuple(None if isinstance(a, RankZeroOnly) else a for a in args)
                self.channel.write("rpc", method, sent, kwargs)
            own = tuple(a.value if isinstance(a, RankZeroOnly) else a for a in args)
            return self.runner.rpc(method, own, kwargs)

        return [self._guarded(call)]

    def result(self, output) -> tuple[list[int], list | None]:
        return self._guarded(output.result)

    def _guarded(self, fn):
        """``fn()`` under ``shielded()``; a dead worker is a RuntimeError, and ends the executor."""
        if self.failure_message:
            raise RuntimeError(self.failure_message)
        if self.workers and (failure := self.workers.failure()):
            self._fail(failure, None)
        try:
            with shielded():
                return fn()
        except Exception as e:
            failure = self.workers.wait_failure(2.0) if self.workers else None
            if failure:
                traceback.clear_frames(e.__traceback__)  # their tensors can then be freed
                self._fail(failure, e)
            raise

    def _fail(self, failure: str, cause: BaseException | None):
        self.failure_message = f"{failure}; the engine has stopped, create a new LLM to continue"
        self.exit()
        raise RuntimeError(self.failure_message) from cause

    def exit(self) -> None:
        """Release every rank, the workers and the shared memory (idempotent)."""
        healthy = self.failure_message is None and not (self.workers and self.workers.failure())
        if self.workers:
            self.workers.closing = True
        if self.runner is not None:
            try:
                if not healthy:
                    raise RuntimeError("a rank is gone")
                if self.channel is not None:
                    self.channel.write("exit")
                self.runner.exit()
            except Exception:
                self.runner.release(failed=True)
            self.runner = None
        self._close_workers(timeout=30.0 if healthy else 1.0)

    def _close_workers(self, timeout: float) -> None:
        if self.workers:
            self.workers.close(timeout=timeout)
            self.workers = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
