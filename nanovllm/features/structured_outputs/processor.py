"""A sequence's grammar as a request processor."""

from nanovllm.features.processors import RequestProcessor, row_extras


class GrammarProcessor(RequestProcessor):
    def __init__(self, grammar):
        self.grammar = grammar  # grammar.SequenceGrammar: it has taken every known token

    def contribute(self, step, row, seq, offset):
        # a prompt chunk before the last samples nothing: no mask this step
        if seq.num_cached_tokens + seq.num_scheduled_tokens < seq.num_tokens:
            return
        import numpy as np

        bitmask = np.empty((1, self.grammar.bitmask_width), dtype=np.int32)
        self.grammar.fill_bitmask(bitmask, 0)
        extra = row_extras(step)
        extra.mask(row, bitmask)
        extra.sync = True

    def accept(self, seq, token_id):
        self.grammar.accept(token_id)
        return self.grammar.is_terminated


def grammar_processor(core, params) -> GrammarProcessor:
    """A fresh matcher of ``params``; the core's compiler is made on first use."""
    compiler = core.shared.get("grammars")
    if compiler is None:
        from nanovllm.features.structured_outputs.grammar import GrammarCompiler
        from nanovllm.utils.model_folder import load_tokenizer

        tokenizer = (
            core.tokenizer if core.tokenizer is not None else load_tokenizer(core.config.model)
        )
        vocab_size = core.config.hf_config.vocab_size
        compiler = core.shared["grammars"] = GrammarCompiler(
            tokenizer, vocab_size, core.eos_token_ids
        )
    return GrammarProcessor(compiler.matcher(params))
