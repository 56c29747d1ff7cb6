"""The front end's input side: prompts and their params checked, all or nothing per call."""

from numbers import Integral

from nanovllm.sampling_params import SamplingParams


def _is_token_sequence(x) -> bool:
    if isinstance(x, (list, tuple)):
        return bool(x) and isinstance(x[0], Integral) and not isinstance(x[0], bool)
    return getattr(x, "ndim", None) == 1  # an array or tensor


def as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)) or _is_token_sequence(prompts):
        return [prompts]
    if getattr(prompts, "ndim", None) == 2 or isinstance(prompts, (list, tuple)):
        return list(prompts)
    msg = "a str, a sequence of token ids, a prompt dict, or a list of them"
    raise TypeError(f"prompts must be {msg}, got {type(prompts).__name__}")


def prompt_token_ids(prompt, tokenizer, vocab_size: int, where: str) -> list[int]:
    """One prompt's token ids, checked against the vocabulary (``where`` names it in errors)."""
    if isinstance(prompt, dict):
        from nanovllm.entrypoints.prompts import unpack

        prompt = unpack(prompt, where)
    if isinstance(prompt, str):
        try:
            token_ids = tokenizer.encode(prompt)
        except (TypeError, ValueError) as error:  # the tokenizer's message names no character
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate such as "\ud800"
                raise ValueError(
                    f"{where}: character {e.start} ({prompt[e.start]!r}) cannot be encoded as "
                    "UTF-8 (a lone surrogate); the prompt must be valid Unicode text"
                ) from error
            raise
    elif isinstance(prompt, (list, tuple)) or getattr(prompt, "ndim", None) == 1:
        token_ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        if set(map(type, token_ids)) - {int}:  # plain ints take this one pass
            token_ids = [_token_id(t, i, where) for i, t in enumerate(token_ids)]
    else:
        got = type(prompt).__name__
        got += f" with shape {tuple(prompt.shape)}" if hasattr(prompt, "shape") else ""
        raise TypeError(
            f"{where}: a prompt must be a str or a 1-D sequence of token ids, got {got}"
        )
    if not token_ids:
        raise ValueError(f"{where}: the prompt is empty")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        i, t = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
        raise ValueError(f"{where}: token {i} is {t}, outside the vocabulary [0, {vocab_size})")
    return token_ids


def _token_id(t, i: int, where: str) -> int:
    if isinstance(t, bool) or not isinstance(t, Integral):
        raise TypeError(f"{where}: token {i} must be an int, got {t!r} ({type(t).__name__})")
    return int(t)


def _snapshot(sp, where: str, inputs) -> SamplingParams:
    if not isinstance(sp, SamplingParams):
        got = type(sp).__name__
        raise TypeError(f"{where}: sampling_params must be a SamplingParams, got {got}")
    if (snap := sp.snapshot()).has_filters:  # bad_words tokenized, ids checked
        from nanovllm.features.token_rules import resolve

        resolve(snap, inputs.tokenizer, inputs.vocab_size, where)
    return snap


class InputProcessor:
    def __init__(self, tokenizer, config, num_kvcache_blocks: int):
        self.tokenizer = tokenizer
        self.vocab_size = config.hf_config.vocab_size
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.block_size = config.kvcache_block_size
        self.num_kvcache_blocks = num_kvcache_blocks
        self.max_logprobs = float("inf") if config.max_logprobs == -1 else config.max_logprobs

    def check(self, prompt, sp: SamplingParams, where: str) -> tuple:
        """``(token_ids, params, text)``: the prompt's text when it was given as text."""
        return self._check(prompt, _snapshot(sp, where, self), where)

    def _check(self, prompt, sp: SamplingParams, where: str) -> tuple:
        token_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size, where)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if sp.n > self.max_num_seqs:
            msg = (
                f"more completions than the engine runs at once (max_num_seqs={self.max_num_seqs})"
            )
            raise ValueError(f"{where}: SamplingParams.n is {sp.n}, {msg}")
        for name, k in (("logprobs", sp.logprobs), ("prompt_logprobs", sp.prompt_logprobs)):
            if k is not None and (self.vocab_size if k == -1 else k) > self.max_logprobs:
                raise ValueError(f"{where}: {name}={k} exceeds max_logprobs={self.max_logprobs}")
        for t in sp.stop_token_ids:
            if t >= self.vocab_size:
                msg = f"outside the vocabulary [0, {self.vocab_size})"
                raise ValueError(f"{where}: stop_token_ids holds {t}, {msg}")
        max_len = self.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"{where}: the prompt has {len(token_ids)} tokens; max_model_len={max_len} leaves "
                f"room for prompts of at most {max_len - 1} tokens"
            )
        blocks = -(-min(len(token_ids) + sp.max_tokens, max_len) // self.block_size)
        if blocks > self.num_kvcache_blocks:
            raise ValueError(
                f"{where}: prompt ({len(token_ids)} tokens) plus max_tokens ({sp.max_tokens}) "
                f"needs up to {blocks} KV-cache blocks of {self.block_size} tokens, but the whole "
                f"cache holds {self.num_kvcache_blocks}"
            )
        return token_ids, sp, text if isinstance(text, str) else None

    def check_all(self, prompts, sampling_params, default) -> list[tuple]:
        """Every prompt of a call with its params, checked before any is queued."""
        prompts = as_prompt_list(prompts)
        sampling_params = default() if sampling_params is None else sampling_params
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(prompts)
        elif len(sampling_params) != len(prompts):
            msg = f"{len(sampling_params)} entries but there are {len(prompts)} prompts"
            raise ValueError(f"sampling_params has {msg}")
        snapshots, checked = {}, []
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            if id(sp) not in snapshots:  # one snapshot per params object of the call
                snapshots[id(sp)] = _snapshot(sp, f"prompts[{i}]", self)
            checked.append(self._check(prompt, snapshots[id(sp)], f"prompts[{i}]"))
        return checked
