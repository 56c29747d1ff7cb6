"""Structured outputs through xgrammar (imported only here, and only when a request uses them): a
spec's grammar; the engine's compiler, which compiles each distinct spec once for the model's
vocabulary; and one matcher per sequence, which fills the row of a token bitmask with the tokens
that may come next and takes each sampled token."""

import json
import re
from collections import OrderedDict

import numpy as np
import xgrammar as xgr

COMPACT_SEPARATORS = (
    ",",
    ":",
)  # disable_any_whitespace: JSON as json.dumps(..., separators=(",", ":"))
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "list of choices",
    "grammar": "EBNF grammar",
}


def build_grammar(params) -> xgr.Grammar:
    """The grammar of a ``StructuredOutputsParams`` (no tokenizer needed): a ValueError naming the
    field when xgrammar rejects the spec."""
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
    """xgrammar's message without its time stamp and source location."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0] if lines else type(error).__name__)


class SequenceGrammar:
    """One sequence's matcher (``Sequence.grammar``): which tokens may come next, and the tokens it
    has taken. It is terminated once it has taken a stop token at the grammar's end (or a token
    the grammar does not allow, which a masked draw never gives); the scheduler then ends the
    sequence with "stop"."""

    def __init__(self, compiled: xgr.CompiledGrammar, bitmask_width: int):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask_width = bitmask_width  # int32 words per bitmask row
        self.rejected = False

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Row ``row`` of ``bitmask`` ([rows, bitmask_width] int32): bit ``t % 32`` of word
        ``t // 32`` is set when token ``t`` may come next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            self.rejected = True

    @property
    def is_terminated(self) -> bool:
        return self.rejected or self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles each distinct spec (``StructuredOutputsParams.key``) once for the engine's
    vocabulary and hands out a fresh matcher per sequence. The model's vocabulary may be larger
    than the tokenizer's (a padded LM head: those ids are never allowed) or, in small test models,
    smaller (the sampler masks only the logits there are)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
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
