"""The executor: runs each step on every tensor-parallel rank. This one is rank 0's ModelRunner
alone (tensor_parallel_size 1); ``MultiprocExecutor`` adds the worker processes of the others."""

from nanovllm.config import Config
from nanovllm.engine.step import Step
from nanovllm.runner.model_runner import ModelRunner, RankZeroOnly, check_parallel


class Executor:
    def __new__(cls, config: Config):
        if config.tensor_parallel_size > 1:  # not an Executor: __init__ is its own
            from nanovllm.runner.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor(config)
        return super().__new__(cls)

    def __init__(self, config: Config):
        check_parallel()
        self.failure_message: str | None = None  # why the engine has stopped, if it has
        self.runner = ModelRunner(config, 0, 0)
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks

    def run(self, step: Step):
        """Launch ``step``; rank 0's output (its tokens on their way to the host)."""
        return self.runner.run(step)

    def result(self, output) -> tuple[list[int], list | None]:
        """A launched step's token ids and per-row extra outputs, once the device has them."""
        return output.result()

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """``ModelRunner.rpc(method, args, kwargs)`` on every rank, between steps; returns
        ``[rank 0's result]``."""
        own = tuple(a.value if isinstance(a, RankZeroOnly) else a for a in args)
        return [self.runner.rpc(method, own, kwargs)]

    def exit(self) -> None:
        """Release the runner (idempotent)."""
        if self.runner is not None:
            runner, self.runner = self.runner, None
            runner.exit()
