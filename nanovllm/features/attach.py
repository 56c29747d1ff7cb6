from nanovllm.features import logits_processors as lp


def attach_processors(seqs: list, eos_token_ids: list[int], core=None, lora=None) -> None:
    """Give each sequence the processors its params ask for; completion 0 scores the prompt;
    ``lora``: the LoRARequest they run with."""
    if lora is not None:
        from nanovllm.lora.manager import adapter_rows

        rows = adapter_rows(core, lora)
    for i, seq in enumerate(seqs):
        sp, procs = seq.sampling_params, []
        stop_ids = list(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop_ids += [e for e in eos_token_ids if e not in sp.stop_token_ids]
        if sp.min_tokens and stop_ids:
            procs.append(lp.MinTokens(sp.min_tokens, stop_ids))
        if sp.has_penalties:
            procs.append(lp.Penalties(sp))
        if sp.has_filters:
            procs += token_rules(sp, core)
        if sp.logprobs is not None:
            procs.append(lp.Logprobs(sp.logprobs if sp.logprobs >= 0 else _vocab_size(core)))
        if sp.structured_outputs is not None:
            from nanovllm.features.structured_outputs.processor import grammar_processor

            procs.append(grammar_processor(core, sp.structured_outputs))
        if i == 0 and sp.prompt_logprobs is not None:
            from nanovllm.features.prompt_logprobs import PromptLogprobs

            num = sp.prompt_logprobs
            procs.append(PromptLogprobs(seq, num if num >= 0 else _vocab_size(core)))
        if lora is not None:
            procs.append(rows(seq))
        seq.processors = procs


def _vocab_size(core) -> int:
    return core.config.hf_config.vocab_size


def token_rules(sp, core) -> list:
    """The processors of top-k/top-p/min-p, allowed_token_ids, bad_words and logit_bias."""
    procs = [lp.Filters(sp)] if lp.truncates(sp) else []
    if sp.allowed_token_ids:
        procs.append(lp.AllowedTokens(sp.allowed_token_ids))
    if sp.bad_words:
        procs.append(lp.BadWords(sp._bad_words_token_ids))
    if sp.logit_bias:
        procs.append(lp.LogitBias(sp.logit_bias))
    return procs
