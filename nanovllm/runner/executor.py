"""The executor: runs each step on every tensor-parallel rank. This one is rank 0's ModelRunner
alone (tensor_parallel_size 1); ``MultiprocExecutor`` adds the worker processes of the others."""

from nanovllm.config import Config
from nanovllm.engine.step import Step
from nanovllm.runner.model_runner import ModelRunner


class RankZeroOnly:
    """A ``collective_rpc`` argument only rank 0 receives (the others get None)."""

    def __init__(self, value):
        self.value = value


def check_parallel() -> None:
    """Reject an engine in a process that already has a process group (the layers take their
    shard from the process's default group)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialised in this process (another "
            "tensor-parallel LLM's, or the program's own): exit() that LLM, or use a new process"
        )


class Executor:
    def __new__(cls, config: Config):
        if cls is Executor and config.tensor_parallel_size > 1:
            from nanovllm.runner.multiproc_executor import MultiprocExecutor

            cls = MultiprocExecutor
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
