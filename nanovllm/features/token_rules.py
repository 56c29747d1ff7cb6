"""``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``detokenize`` and ``extra_args``: their
checks (pure Python), and what the front end resolves against the model's vocabulary."""

import math

MAX_BAD_WORDS = 128  # token sequences after tokenization (vLLM's default limit)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _fail(name: str, value, allowed: str, error=ValueError):
    raise error(f"SamplingParams.{name} must be {allowed}, got {value!r}")


def check_options(v: dict) -> None:
    """The options' types and values, normalised in ``v`` (the dict ``_checked`` builds)."""
    if v["structured_outputs"] is not None:
        from nanovllm.features.structured_outputs.params import check_sampling_params

        check_sampling_params(v)
    bias = v["logit_bias"]
    if bias is not None:
        what = "a dict of token id (int) to a finite number, or None"
        if not isinstance(bias, dict):
            _fail("logit_bias", bias, what, TypeError)
        for t, b in bias.items():
            if not _is_int(t) or not isinstance(b, (int, float)) or isinstance(b, bool):
                _fail("logit_bias", bias, what, TypeError)
            if t < 0 or not math.isfinite(b):
                _fail("logit_bias", bias, "token ids >= 0 mapped to finite numbers")
        v["logit_bias"] = {t: float(b) for t, b in bias.items()}
    allowed = v["allowed_token_ids"]
    if allowed is not None:
        if not isinstance(allowed, (list, tuple)) or not all(map(_is_int, allowed)):
            _fail("allowed_token_ids", allowed, "a list of token ids (int) or None", TypeError)
        if not allowed or min(allowed) < 0:
            _fail("allowed_token_ids", allowed, "a non-empty list of token ids >= 0, or None")
        v["allowed_token_ids"] = list(allowed)
    words = v["bad_words"]
    if words is not None:
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            _fail("bad_words", words, "a list of str or None", TypeError)
        if not all(w.strip() for w in words):
            _fail("bad_words", words, "a list of non-blank strings")
        v["bad_words"] = list(dict.fromkeys(words))  # repeats dropped, as in vLLM
    ids = v["_bad_words_token_ids"]
    if ids is not None and not (
        isinstance(ids, list) and all(isinstance(w, list) and all(map(_is_int, w)) for w in ids)
    ):
        _fail("_bad_words_token_ids", ids, "a list of lists of token ids, or None", TypeError)
    if v["extra_args"] is not None and not isinstance(v["extra_args"], dict):
        _fail("extra_args", v["extra_args"], "a dict or None", TypeError)
    if not v["detokenize"] and v["stop"]:
        msg = f"stop strings need detokenize=True, got detokenize=False and stop={v['stop']!r}"
        raise ValueError(f"SamplingParams.detokenize: {msg}; use stop_token_ids instead")


def _vocab_check(name: str, ids, vocab_size: int, where: str) -> None:
    if bad := sorted({t for t in ids if t >= vocab_size}):
        msg = f"token ids {bad} outside the vocabulary [0, {vocab_size})"
        raise ValueError(f"{where}: SamplingParams.{name} holds {msg}")


def bad_words_token_ids(words: list[str], tokenizer, vocab_size: int, where: str) -> list:
    """Each word as tokens alone and after a space (vLLM's rule: the spaced form only when it is
    a different word of as many tokens)."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"{where}: SamplingParams.bad_words: {word!r} encodes to no token")
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    if len(out) > MAX_BAD_WORDS:
        msg = f"{len(out)} token sequences, more than {MAX_BAD_WORDS}"
        raise ValueError(f"{where}: SamplingParams.bad_words tokenizes to {msg}")
    return [w for w in out if max(w) < vocab_size]  # one the model cannot produce never appears


def resolve(sp, tokenizer, vocab_size: int, where: str) -> None:
    """A snapshot's ids checked against the vocabulary and its bad words tokenized, in place."""
    _vocab_check("logit_bias", sp.logit_bias or (), vocab_size, where)
    _vocab_check("allowed_token_ids", sp.allowed_token_ids or (), vocab_size, where)
    words = (
        bad_words_token_ids(sp.bad_words, tokenizer, vocab_size, where) if sp.bad_words else None
    )
    sp.__dict__["_bad_words_token_ids"] = words  # set as it is, the snapshot's tuples kept
