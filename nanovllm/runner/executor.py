"""Runs each step on every rank: here rank 0's ModelRunner alone (tensor_parallel_size 1)."""

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
        return self.runner.run(step)

    def result(self, output) -> tuple[list[int], list | None]:
        return output.result()

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        own = tuple(a.value if isinstance(a, RankZeroOnly) else a for a in args)
        return [self.runner.rpc(method, own, kwargs)]

    def exit(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            runner.exit()
