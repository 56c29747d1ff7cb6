"""What a request's completion must match (docs/features.md)."""

import json
from dataclasses import dataclass, field

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of json, regex, choice, grammar, json_object; checked when made."""

    json: dict | str | None = None  # a JSON schema, or its JSON text
    regex: str | None = None  # matched in full
    choice: list[str] | None = None  # non-empty strings
    grammar: str | None = None  # EBNF (GBNF) from the rule ``root``
    json_object: bool | None = None  # True: any JSON object
    disable_any_whitespace: bool = False  # compact JSON, "," and ":" as separators
    _key: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                "json_object; "
                f"got {', '.join(given) if given else 'none'}"
            )
        kind = given[0]
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError(
                f"StructuredOutputsParams.disable_any_whitespace must be a bool, "
                f"got {self.disable_any_whitespace!r}"
            )
        key = (kind, _spec_text(kind, getattr(self, kind)), self.disable_any_whitespace)
        object.__setattr__(self, "_key", key)
        # xgrammar: only for structured outputs
        from nanovllm.features.structured_outputs.grammar import build_grammar

        build_grammar(self)

    @property
    def kind(self) -> str:
        return self._key[0]

    @property
    def spec(self) -> str:
        """The value as text: the schema as canonical JSON, the choices as a JSON list."""
        return self._key[1]

    @property
    def key(self) -> tuple:
        """Equal keys compile to the same grammar."""
        return self._key


def _spec_text(kind: str, value) -> str:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(
                    f"StructuredOutputsParams.json is not valid JSON ({e}): {_short(value)}"
                ) from None
        if not isinstance(value, dict):
            raise TypeError(
                f"StructuredOutputsParams.json must be a JSON schema (a dict or its JSON text), "
                f"got {_short(value)} ({type(value).__name__})"
            )
        try:
            return json.dumps(value, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"StructuredOutputsParams.json must hold JSON values only ({e})"
            ) from None
    if kind == "choice":
        if (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(c, str) for c in value)
        ):
            raise TypeError(
                "StructuredOutputsParams.choice must be a non-empty list of str, "
                f"got {_short(value)}"
            )
        if not all(value):
            raise ValueError(
                f"StructuredOutputsParams.choice must not hold an empty string, got {_short(value)}"
            )
        return json.dumps(list(value), ensure_ascii=False)
    if kind == "json_object":
        if value is not True:
            raise TypeError(f"StructuredOutputsParams.json_object must be a bool, got {value!r}")
        return ""
    if not isinstance(value, str):  # regex, grammar
        raise TypeError(
            f"StructuredOutputsParams.{kind} must be a str, "
            f"got {_short(value)} ({type(value).__name__})"
        )
    if not value:
        raise ValueError(f"StructuredOutputsParams.{kind} must not be empty")
    return value


def _short(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_sampling_params(v: dict) -> None:
    """``SamplingParams``' check of its ``structured_outputs`` field (``v``: the fields)."""
    so = v["structured_outputs"]
    if not isinstance(so, StructuredOutputsParams):
        msg = f"must be a StructuredOutputsParams or None, got {so!r}"
        raise TypeError(f"SamplingParams.structured_outputs {msg}")
    if v["min_tokens"]:
        msg = "(the grammar decides where the completion ends)"
        raise ValueError(
            f"SamplingParams.min_tokens must be 0 with structured_outputs {msg}, "
            f"got min_tokens={v['min_tokens']}"
        )
