"""What ``generate``, ``chat``, ``LLMEngine.step`` and ``AsyncLLM.generate`` return: vLLM's output
objects, which also answer the original dict keys (``output["text"]``, ``output["token_ids"]``)."""

from dataclasses import dataclass, field, fields

from nanovllm.sampling_params import RequestOutputKind

__all__ = ["CompletionOutput", "RequestOutput", "RequestOutputKind"]  # Logprob: nanovllm.logprobs


class _Keys:
    """``obj[key]``, ``obj.get(key)`` and ``obj.keys()`` over the fields, as the dicts once."""

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if f.repr]

    def __getitem__(self, key: str):
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default=None):
        return self[key] if key in self.keys() else default


@dataclass
class CompletionOutput(_Keys):
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict] | None  # {token_id: Logprob} per token
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    lora_request: object = field(default=None, repr=False)

    def finished(self) -> bool:
        return self.finish_reason is not None


COMPLETION_KEYS = ("text", "token_ids", "finish_reason", "stop_reason", "logprobs")
COMPLETION_KEYS += ("cumulative_logprob",)


@dataclass
class RequestOutput(_Keys):
    """One request; ``output[key]`` of a completion field reads completion 0's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: object = field(default=None, repr=False)
    lora_request: object = field(default=None, repr=False)

    def keys(self) -> list[str]:
        return list(COMPLETION_KEYS) + super().keys()

    def __getitem__(self, key: str):
        if key in COMPLETION_KEYS:
            return getattr(self.outputs[0], key)
        return super().__getitem__(key)
