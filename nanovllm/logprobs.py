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


def with_ranks(entry: dict[int, float], tokenizer, texts: dict[int, str]) -> dict[int, Logprob]:
    """The top entries in rank order, then the chosen token when it is not among them;
    ``texts`` caches each token's decoded text."""
    if missing := [t for t in entry if t not in texts]:
        texts.update(zip(missing, tokenizer.batch_decode([[t] for t in missing])))
    return {t: Logprob(v, r, texts[t]) for r, (t, v) in enumerate(entry.items(), 1)}
