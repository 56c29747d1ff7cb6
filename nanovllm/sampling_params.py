"""Per-request sampling settings, with vLLM's names, defaults and meaning (pure Python: imported
by the engine core). Every field is checked here; a bad value is a TypeError or ValueError naming
the field, the value and what is allowed."""

from dataclasses import dataclass, fields, replace

from nanovllm.features.structured_outputs.params import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]

GREEDY_BELOW = (
    1e-5  # a temperature under this samples greedily (as in vLLM): logits / T would overflow
)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _checked(values: dict) -> dict:
    """Every field's value checked, and normalised (numbers as float, ``stop`` and
    ``stop_token_ids`` as lists, ``top_k=-1`` as 0); ``values`` holds every field. The one check,
    run by the constructor and by every assignment."""
    v = dict(values)
    _check_number(
        v, "temperature", lambda t: 0 <= t < float("inf"), "a finite number >= 0 (0 = greedy)"
    )
    _check_int(v, "max_tokens", 1)
    _check_int(v, "n", 1)
    _check_number(v, "top_p", lambda p: 0 < p <= 1, "in (0, 1] (1 = off)")
    _check_int(v, "top_k", -1, extra=" (0 or -1 = off)")
    _check_number(v, "min_p", lambda p: 0 <= p <= 1, "in [0, 1] (0 = off)")
    _check_int(v, "min_tokens", 0)
    if v["min_tokens"] > v["max_tokens"]:
        raise ValueError(
            f"SamplingParams.min_tokens must be <= max_tokens, got min_tokens={v['min_tokens']} "
            f"and max_tokens={v['max_tokens']}"
        )
    _check_number(
        v, "repetition_penalty", lambda r: 0 < r < float("inf"), "a finite number > 0 (1 = off)"
    )
    for name in ("presence_penalty", "frequency_penalty"):
        _check_number(v, name, lambda x: -2 <= x <= 2, "in [-2, 2] (0 = off)")
    if v["seed"] is not None and not _is_int(v["seed"]):
        raise TypeError(
            f"SamplingParams.seed must be an int or None, got {v['seed']!r} ({type(v['seed']).__name__})"
        )
    for name in ("logprobs", "prompt_logprobs"):
        if v[name] is not None:
            _check_int(v, name, 0, extra=" or None")
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if not isinstance(v[name], bool):
            raise TypeError(f"SamplingParams.{name} must be a bool, got {v[name]!r}")
    _check_structured_outputs(v)
    v["stop"] = _string_list(v["stop"])
    v["stop_token_ids"] = _id_list(v["stop_token_ids"])
    if v["top_k"] == -1:
        v["top_k"] = 0
    return v


def _check_number(v: dict, name: str, ok, allowed: str) -> None:
    value = v[name]
    if not _is_number(value):
        raise TypeError(
            f"SamplingParams.{name} must be a number, got {value!r} ({type(value).__name__})"
        )
    if not ok(value):  # NaN fails every comparison
        raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")
    v[name] = float(value)


def _check_int(v: dict, name: str, low: int, extra: str = "") -> None:
    value = v[name]
    if not _is_int(value):
        raise TypeError(
            f"SamplingParams.{name} must be an int{extra}, got {value!r} ({type(value).__name__})"
        )
    if value < low:
        raise ValueError(f"SamplingParams.{name} must be >= {low}{extra}, got {value}")


def _check_structured_outputs(v: dict) -> None:
    so = v["structured_outputs"]
    if so is None:
        return
    if not isinstance(so, StructuredOutputsParams):
        raise TypeError(
            f"SamplingParams.structured_outputs must be a StructuredOutputsParams or None, got {so!r}"
        )
    if v["min_tokens"]:  # the grammar decides where the completion ends
        raise ValueError(
            f"SamplingParams.min_tokens must be 0 with structured_outputs (the grammar decides where the "
            f"completion ends), got min_tokens={v['min_tokens']}"
        )


def _string_list(stop) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise TypeError(f"SamplingParams.stop must be a str, a list of str or None, got {stop!r}")
    if any(not s for s in items):
        raise ValueError(f"SamplingParams.stop must not contain an empty string, got {stop!r}")
    return list(items)


def _id_list(ids) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) for i in ids):
        raise TypeError(f"SamplingParams.stop_token_ids must be a list of int or None, got {ids!r}")
    if any(i < 0 for i in ids):
        raise ValueError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {ids!r}")
    return list(ids)


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    Order on the logits, as in vLLM: ``min_tokens`` suppression, penalties, temperature, min-p,
    top-k, top-p; greedy (``temperature=0``) takes the argmax after the penalties.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature); below
        1e-5 it is greedy too.
    max_tokens: most completion tokens (the request also stops at EOS, a stop condition or max_model_len).
    ignore_eos: keep generating past the end-of-sequence token.
    n: completions per prompt; they share the prompt's cached blocks. Completion ``i`` of a seeded
        request uses ``seed + i``.
    top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (the token
        that crosses it included); 1 = off.
    top_k: keep the ``top_k`` most likely tokens; 0 or -1 = off.
    min_p: drop tokens whose probability is below ``min_p`` times the most likely one's; 0 = off.
    seed: a seeded request draws the same tokens whatever else is in the batch (same device and dtype).
    stop: strings that end the completion when they appear in its text (across token boundaries);
        they are removed from ``text`` unless ``include_stop_str_in_output``.
    stop_token_ids: token ids that end the completion; the id stays in ``token_ids``.
    min_tokens: EOS and ``stop_token_ids`` are suppressed, and stop strings not checked, until this
        many tokens have been generated.
    repetition_penalty: over prompt and output tokens, positive logits are divided by it and
        negative ones multiplied; 1 = off.
    presence_penalty, frequency_penalty: over output tokens,
        ``logits -= frequency_penalty * count + presence_penalty * (count > 0)``.
    logprobs: None, or how many top tokens' log-probabilities to return per generated token (the
        sampled token's is always included); from log_softmax of the raw logits.
    skip_special_tokens: leave special tokens out of ``text``.
    prompt_logprobs: None, or how many top tokens' log-probabilities to return for each prompt
        token after the first (the prompt token's own is always included), from log_softmax of
        the raw logits at the position before it. A request that asks computes its whole prompt:
        it takes no prefix-cache hits (its blocks still serve later requests).
    structured_outputs: a ``StructuredOutputsParams``: the completion matches its JSON schema,
        regex, choices or grammar; it ends with "stop" where the grammar ends (also with
        ``ignore_eos``), or with "length" at ``max_tokens``. Not with ``min_tokens``.
    """

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
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.__dict__.update(_checked({name: self.__dict__[name] for name in _FIELDS}))

    def __setattr__(self, name: str, value) -> None:
        """Assignment after construction runs the constructor's checks on the new set of values:
        a bad value (or one that breaks ``min_tokens <= max_tokens``) raises and leaves the old
        value in place; a good one is normalised as the constructor would."""
        if name not in _FIELDS:
            raise AttributeError(
                f"SamplingParams has no field {name!r}; fields: {', '.join(_FIELDS)}"
            )
        if (
            name not in self.__dict__
        ):  # the dataclass __init__ sets each field once, then checks them all
            object.__setattr__(self, name, value)
            return
        self.__dict__.update(_checked({**{f: self.__dict__[f] for f in _FIELDS}, name: value}))

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"SamplingParams fields cannot be deleted (tried {name!r})")

    # ---- derived, for the engine ---------------------------------------------------------------

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_filters(self) -> bool:
        """top-k, top-p or min-p restrict the tokens a non-greedy draw may return."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    def for_completion(self, index: int) -> "SamplingParams":
        """The settings of completion ``index`` of ``n``: one completion, seed + index when seeded."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


_FIELDS = tuple(f.name for f in fields(SamplingParams))
