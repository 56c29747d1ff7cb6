"""Request intake: prompts in every accepted form, checked, and one request's ``n`` completions."""
from numbers import Integral

from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


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
        token_ids = tokenizer.encode(prompt)
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


class Request:
    """One prompt and its ``n`` completions. Completion 0 is computed first; the others are admitted
    once its prompt is in the cache, so they share the prompt's full blocks (``Sequence.wait_for``)."""

    def __init__(
        self, token_ids: list[int], sampling_params: SamplingParams, block_size: int, eos_token_ids: list[int],
        tokenizer=None,
    ):
        """With ``tokenizer``, every completion gets a detokenizer (streams, or stop strings)."""
        sp = sampling_params
        self.prompt_token_ids = token_ids
        self.sampling_params = sp
        self.seqs = [Sequence(token_ids, sp.for_completion(i) if sp.n > 1 else sp, block_size) for i in range(sp.n)]
        suppressed = [] if sp.ignore_eos else [e for e in eos_token_ids if e not in sp.stop_token_ids]
        for seq in self.seqs:
            seq.request_id = self.seqs[0].seq_id
            seq.min_tokens_ids += suppressed
            if len(token_ids) > block_size and seq is not self.seqs[0]:
                seq.wait_for = self.seqs[0]
            if tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(
                    tokenizer, sp.stop, sp.include_stop_str_in_output, sp.skip_special_tokens
                )
        self.request_id = self.seqs[0].seq_id

    @property
    def is_finished(self) -> bool:
        return all(seq.is_complete for seq in self.seqs)
