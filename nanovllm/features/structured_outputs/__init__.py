"""Structured outputs: a completion constrained to a JSON schema, a regex, a list of choices or an
EBNF grammar. ``params`` is the request's spec (pure Python); ``grammar`` compiles it and matches
each sequence's tokens through xgrammar, imported only when a request uses structured outputs."""

from nanovllm.features.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
