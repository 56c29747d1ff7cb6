"""Prompts in every accepted form: text or token ids, each id checked against the vocabulary."""

from numbers import Integral


def _is_token_sequence(x) -> bool:
    """A 1-D sequence of token ids: a list or tuple starting with an int, or a 1-D array/tensor."""
    if isinstance(x, (list, tuple)):
        return bool(x) and isinstance(x[0], Integral) and not isinstance(x[0], bool)
    return getattr(x, "ndim", None) == 1


def as_prompt_list(prompts) -> list:
    """``generate``'s prompts as a list: a single string or token sequence becomes a list of one."""
    if isinstance(prompts, str) or _is_token_sequence(prompts):
        return [prompts]
    if getattr(prompts, "ndim", None) == 2:  # a 2-D array or tensor: one prompt per row
        return list(prompts)
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a str, a sequence of token ids, or a list of them, got {type(prompts).__name__}"
        )
    return list(prompts)


def prompt_token_ids(prompt, tokenizer, vocab_size: int, where: str) -> list[int]:
    """The token ids of one prompt (text, or any 1-D sequence of integers), each checked against
    the model's vocabulary (a tokenizer may know more tokens than a small model)."""
    if isinstance(prompt, str):
        try:
            token_ids = tokenizer.encode(prompt)
        except (
            TypeError,
            ValueError,
        ) as error:  # tokenizers' message names neither prompt nor character
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate such as "\ud800"
                raise ValueError(
                    f"{where}: character {e.start} ({prompt[e.start]!r}) cannot be encoded as UTF-8 "
                    "(a lone surrogate); the prompt must be valid Unicode text"
                ) from error
            raise
    elif isinstance(prompt, (list, tuple)) or getattr(prompt, "ndim", None) == 1:
        token_ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        if set(map(type, token_ids)) - {int}:  # the common case (plain ints) takes this one pass
            token_ids = [_token_id(t, i, where) for i, t in enumerate(token_ids)]
    else:
        shape = f" with shape {tuple(prompt.shape)}" if hasattr(prompt, "shape") else ""
        raise TypeError(
            f"{where}: a prompt must be a str or a 1-D sequence of token ids, got {type(prompt).__name__}{shape}"
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
