"""A data-parallel replica: an engine core serving plain-message calls."""

from dataclasses import dataclass, field

from nanovllm.engine.core import EngineCore, SeqOutput
from nanovllm.sampling_params import SamplingParams


class ReplicaDied(RuntimeError):
    """A replica's process or actor is gone."""


@dataclass
class ReplicaCall:
    # EngineCore.add_request's arguments
    adds: list[tuple[int, list[int], SamplingParams, bool, object]] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)
    finishes: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, request_id)
    step: bool = True

    def __bool__(self) -> bool:
        return bool(self.adds or self.aborts or self.finishes)


@dataclass
class ReplicaControl:
    """``EngineCore.<method>(*args)``, sent only to an idle replica."""

    method: str
    args: tuple = ()


CONTROL_METHODS = ("collective_rpc", "reset_prefix_cache", "preempt_all", "lora")


@dataclass
class ReplicaReply:
    outputs: list[SeqOutput]
    num_tokens: int  # EngineCore.step's: prefill tokens (> 0) or minus the sequences decoded
    finished: bool  # nothing queued or in flight is left
    stats: dict  # EngineCore.stats()


class ReplicaServer:
    """A replica's engine core, driven one call at a time."""

    def __init__(self, config, eos_token_ids: list[int]):
        from nanovllm.runner.executor import Executor  # torch: only where a replica runs

        self.core = EngineCore(config, eos_token_ids, Executor(config))

    def ready(self) -> tuple[int, dict]:
        return self.core.num_kvcache_blocks, self.core.stats()

    def call(self, call: ReplicaCall) -> ReplicaReply:
        core = self.core
        for add in call.adds:
            core.add_request(*add)
        for request_id in call.aborts:
            core.abort_request(request_id)
        for seq_id, request_id in call.finishes:
            core.finish_sequence(seq_id, request_id)
        outputs, num_tokens = [], 0
        if call.step and not core.is_finished():
            outputs, num_tokens = core.step()
        if core.is_finished():
            outputs += core.settle()  # nothing in flight while the replica waits for its next call
        return ReplicaReply(outputs, num_tokens, core.is_finished(), core.stats())

    def control(self, control: ReplicaControl):
        if control.method not in CONTROL_METHODS:
            raise ValueError(
                f"unknown replica control {control.method!r}; known: {', '.join(CONTROL_METHODS)}"
            )
        if control.method == "preempt_all":
            from nanovllm.features.idle import preempt_all

            preempt_all(self.core)
            return self.core.stats()
        if control.method == "lora":
            from nanovllm.lora.manager import call

            return call(self.core, *control.args)
        return getattr(self.core, control.method)(*control.args)

    def exit(self) -> None:
        self.core.exit()
