"""What a request's completion must match: a JSON schema, a regex, one of some strings, an EBNF
grammar, or any JSON object (pure Python; xgrammar is imported only to check a spec's syntax)."""

import json
from dataclasses import dataclass, field

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` (vLLM's names).

    json: a JSON schema (a dict, or its JSON text); the completion is a JSON value valid for it.
    regex: the completion fully matches this regular expression.
    choice: the completion is one of these (non-empty) strings.
    grammar: an EBNF grammar in xgrammar's (GBNF) syntax, starting at the rule ``root``.
    json_object: True: the completion is any JSON object.
    disable_any_whitespace: JSON (``json``, ``json_object``) without free whitespace: compact, with
        ``,`` and ``:`` as separators.

    A spec is checked when it is made (its syntax through xgrammar, which needs no tokenizer): a bad
    one is a ValueError or TypeError naming the field. Frozen: a checked spec stays checked.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
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
        object.__setattr__(
            self, "_key", (kind, _spec_text(kind, getattr(self, kind)), self.disable_any_whitespace)
        )
        from nanovllm.features.structured_outputs.grammar import (
            build_grammar,
        )  # xgrammar: only for structured outputs

        build_grammar(self)

    @property
    def kind(self) -> str:
        """Which of the five is given."""
        return self._key[0]

    @property
    def spec(self) -> str:
        """The given value as text: the schema as canonical JSON, the choices as a JSON list."""
        return self._key[1]

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar: equal keys compile to the same grammar."""
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
