"""Structured outputs through xgrammar, imported only when a request uses them."""

import json
import re
from collections import OrderedDict

import numpy as np
import xgrammar as xgr

# disable_any_whitespace: JSON as json.dumps(..., separators=(",", ":"))
COMPACT_SEPARATORS = (",", ":")
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "list of choices",
    "grammar": "EBNF grammar",
}


def build_grammar(params) -> xgr.Grammar:
    """A spec's grammar (no tokenizer needed); ValueError naming the field if it is bad."""
    kind, spec, compact = params.key
    json_style = {
        "any_whitespace": not compact,
        "separators": COMPACT_SEPARATORS if compact else None,
    }
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, **json_style)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', strict_mode=False, **json_style
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":  # each choice an EBNF string literal (JSON's escapes are EBNF's)
            return xgr.Grammar.from_ebnf(
                "root ::= "
                + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))
            )
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        value = spec if len(spec) <= 200 else spec[:200] + "..."
        raise ValueError(
            f"StructuredOutputsParams.{kind} is not a valid {_WHAT[kind]} ({_reason(e)}): {value}"
        ) from None


def _reason(error: Exception) -> str:
    # xgrammar's message without its time stamp and source location
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0] if lines else type(error).__name__)


class SequenceGrammar:
    """One sequence's matcher; terminated after a stop token at the grammar's end."""

    def __init__(self, compiled: xgr.CompiledGrammar, bitmask_width: int):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask_width = bitmask_width  # int32 words per bitmask row
        self.rejected = False

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        # bit t % 32 of word t // 32 is set when token t may come next
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            self.rejected = True

    @property
    def is_terminated(self) -> bool:
        return self.rejected or self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles each distinct spec once (LRU cache); a fresh matcher per sequence."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        # a padded LM head's extra ids are never allowed; a smaller vocabulary (tiny test
        # models) has the sampler mask only the logits there are
        size = max(vocab_size, len(tokenizer))
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=size, stop_token_ids=stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.bitmask_width = (size + 31) // 32
        self.compiled: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()

    def compile(self, params) -> xgr.CompiledGrammar:
        compiled = self.compiled.get(params.key)
        if compiled is None:
            compiled = self.compiled[params.key] = self.compiler.compile_grammar(
                build_grammar(params)
            )
            if len(self.compiled) > CACHE_SIZE:
                self.compiled.popitem(last=False)
        else:
            self.compiled.move_to_end(params.key)
        return compiled

    def matcher(self, params) -> SequenceGrammar:
        return SequenceGrammar(self.compile(params), self.bitmask_width)
