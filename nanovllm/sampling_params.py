"""Per-request sampling settings, with vLLM's names and meaning (pure Python)."""

import copy
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum

__all__ = ["RequestOutputKind", "SamplingParams"]  # and StructuredOutputsParams, when asked for

GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (as in vLLM)


def __getattr__(name: str):
    if name == "StructuredOutputsParams":  # the feature's module loads only when asked for
        from nanovllm.features.structured_outputs.params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RequestOutputKind(IntEnum):
    """What a stream hands out each step: everything so far, the new part, or the end alone."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _checked(values: dict) -> dict:
    """Every field checked and normalised (floats, lists, ``top_k=-1`` as 0): the one check."""
    v = dict(values)
    inf = float("inf")
    _number(v, "temperature", lambda t: 0 <= t < inf, "a finite number >= 0 (0 = greedy)")
    _int(v, "max_tokens", 1)
    _int(v, "n", 1)
    _number(v, "top_p", lambda p: 0 < p <= 1, "in (0, 1] (1 = off)")
    _int(v, "top_k", -1, " (0 or -1 = off)")
    _number(v, "min_p", lambda p: 0 <= p <= 1, "in [0, 1] (0 = off)")
    _int(v, "min_tokens", 0)
    if (low := v["min_tokens"]) > (high := v["max_tokens"]):
        msg = f"got min_tokens={low} and max_tokens={high}"
        raise ValueError(f"SamplingParams.min_tokens must be <= max_tokens, {msg}")
    _number(v, "repetition_penalty", lambda r: 0 < r < inf, "a finite number > 0 (1 = off)")
    for name in ("presence_penalty", "frequency_penalty"):
        _number(v, name, lambda x: -2 <= x <= 2, "in [-2, 2] (0 = off)")
    if (seed := v["seed"]) is not None and not _is_int(seed):
        raise TypeError(f"SamplingParams.seed must be an int or None, got {seed!r} ({_type(seed)})")
    for name in ("logprobs", "prompt_logprobs"):
        if v[name] is not None:
            _int(v, name, -1, " or None (-1: the whole vocabulary)")
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
        if not isinstance(v[name], bool):
            raise TypeError(f"SamplingParams.{name} must be a bool, got {v[name]!r}")
    if not v["detokenize"] or any(v[name] is not None for name in _OPTIONS):
        from nanovllm.features.token_rules import check_options

        check_options(v)
    if not isinstance(v["output_kind"], RequestOutputKind):
        kind = v["output_kind"]
        raise TypeError(f"SamplingParams.output_kind must be a RequestOutputKind, got {kind!r}")
    v["stop"] = _string_list(v["stop"])
    v["stop_token_ids"] = _id_list(v["stop_token_ids"])
    v["top_k"] = max(v["top_k"], 0)  # -1 is 0 (off)
    return v


def _type(x) -> str:
    return type(x).__name__


def _number(v: dict, name: str, ok, allowed: str) -> None:
    value = v[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"SamplingParams.{name} must be a number, got {value!r} ({_type(value)})")
    if not ok(value):  # NaN fails every comparison
        raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")
    v[name] = float(value)


def _int(v: dict, name: str, low: int, extra: str = "") -> None:
    value = v[name]
    if not _is_int(value):
        msg = f"got {value!r} ({_type(value)})"
        raise TypeError(f"SamplingParams.{name} must be an int{extra}, {msg}")
    if value < low:
        raise ValueError(f"SamplingParams.{name} must be >= {low}{extra}, got {value}")


def _string_list(stop) -> list[str]:
    items = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise TypeError(f"SamplingParams.stop must be a str, a list of str or None, got {stop!r}")
    if any(not s for s in items):
        raise ValueError(f"SamplingParams.stop must not contain an empty string, got {stop!r}")
    return list(items)


def _id_list(ids) -> list[int]:
    ids = [] if ids is None else ids
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) for i in ids):
        raise TypeError(f"SamplingParams.stop_token_ids must be a list of int or None, got {ids!r}")
    if any(i < 0 for i in ids):
        raise ValueError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {ids!r}")
    return list(ids)


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops. Every assignment is checked like the
    constructor (a bad value: an error naming the field, the value and what is allowed)."""

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    n: int = 1
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    structured_outputs: "StructuredOutputsParams | None" = None  # noqa: F821
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # streams (LLMEngine, AsyncLLM)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    detokenize: bool = True
    extra_args: dict | None = None  # kept for custom code; no effect here
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)  # bad_words' ids

    def __post_init__(self) -> None:
        self.__dict__.update(_checked({name: self.__dict__[name] for name in _FIELDS}))

    def __setattr__(self, name: str, value) -> None:
        if name not in _FIELDS:  # a bad value raises (below) and the old one stays
            msg = f"SamplingParams has no field {name!r}; fields: {', '.join(_FIELDS)}"
            raise AttributeError(msg)
        if name not in self.__dict__:  # the dataclass __init__ sets each field once
            return object.__setattr__(self, name, value)
        self.__dict__.update(_checked({**{f: self.__dict__[f] for f in _FIELDS}, name: value}))

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"SamplingParams fields cannot be deleted (tried {name!r})")

    clone = copy.deepcopy

    def snapshot(self) -> "SamplingParams":
        """What a queued request reads: a checked copy, ``stop``/``stop_token_ids`` as tuples."""
        values = _checked(copy.deepcopy({f: self.__dict__[f] for f in _FIELDS}))
        values.update(stop=tuple(values["stop"]), stop_token_ids=tuple(values["stop_token_ids"]))
        snap = object.__new__(SamplingParams)
        snap.__dict__.update(values)
        return snap

    @property
    def has_penalties(self) -> bool:
        penalties = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        return penalties != (1.0, 0.0, 0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_filters(self) -> bool:
        drawn = not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)
        return drawn or any(getattr(self, name) for name in _OPTIONS[:3])

    def for_completion(self, index: int) -> "SamplingParams":
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


_FIELDS = tuple(f.name for f in fields(SamplingParams))
_OPTIONS = ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs", "extra_args")
