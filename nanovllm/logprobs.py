"""A token's log-probability as ``logprobs`` and ``prompt_logprobs`` report it."""

__all__ = ["Logprob"]


class Logprob(float):
    """A token's log-probability: a float, with vLLM's ``logprob``, ``rank`` (1 = most likely)
    and ``decoded_token``."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        text = self.decoded_token
        return f"Logprob(logprob={float(self)!r}, rank={self.rank}, decoded_token={text!r})"

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)


def with_ranks(entry: dict[int, tuple], tokenizer, texts: dict[int, str]) -> dict[int, Logprob]:
    """``{token_id: (logprob, rank)}`` as ``Logprob``s, in its order; ``texts`` caches each token's
    decoded text; no tokenizer: no text (``detokenize=False``)."""
    if tokenizer is None:
        return {t: Logprob(v, r) for t, (v, r) in entry.items()}
    if missing := [t for t in entry if t not in texts]:
        texts.update(zip(missing, tokenizer.batch_decode([[t] for t in missing])))
    return {t: Logprob(v, r, texts[t]) for t, (v, r) in entry.items()}


def ranked(entries: list | None, tokenizer, texts: dict | None = None) -> list | None:
    """Entries ``{token_id: (logprob, rank)}`` (None for a prompt's first token) as ``Logprob``s."""
    if entries is None:
        return None
    texts = {} if texts is None else texts
    return [e and with_ranks(e, tokenizer, texts) for e in entries]
