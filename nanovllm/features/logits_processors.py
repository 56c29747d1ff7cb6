"""Request processors that shape a row's sampling (docs/features.md)."""

from nanovllm.features.processors import RequestProcessor, row_extras


class MinTokens(RequestProcessor):
    def __init__(self, min_tokens: int, token_ids: list[int]):
        self.min_tokens, self.token_ids = min_tokens, token_ids

    def contribute(self, step, row, seq, offset):
        if seq.num_completion_tokens < self.min_tokens:
            row_extras(step).add("suppressed", row, self.token_ids)


class Penalties(RequestProcessor):
    def __init__(self, sp):
        self.values = (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty)

    def contribute(self, step, row, seq, offset):
        extra = row_extras(step)
        extra.set("penalties", row, (*self.values, seq.prompt_token_ids, seq.completion_token_ids))
        extra.sync = True  # the next step needs this step's token on the host


class Filters(RequestProcessor):
    def __init__(self, sp):
        self.values = (sp.top_k, sp.top_p, sp.min_p)

    def contribute(self, step, row, seq, offset):
        row_extras(step).set("filters", row, self.values)


class LogitBias(RequestProcessor):
    def __init__(self, bias: dict[int, float]):
        self.value = (list(bias), list(bias.values()))

    def contribute(self, step, row, seq, offset):
        row_extras(step).set("bias", row, self.value)


class AllowedTokens(RequestProcessor):
    def __init__(self, token_ids: list[int]):
        import numpy as np

        bits = np.zeros(-(-(max(token_ids) + 1) // 32) * 32, dtype=np.uint8)  # 0 past the mask
        bits[token_ids] = 1
        # bit t % 32 of word t // 32, least significant first: xgrammar's layout
        self.bitmask = np.packbits(bits, bitorder="little").view("<i4").reshape(1, -1)

    def contribute(self, step, row, seq, offset):
        row_extras(step).mask(row, self.bitmask)


class BadWords(RequestProcessor):
    """A one-token word is never sampled; a longer one's last token is not sampled right after
    the completion's last tokens are the word's others (vLLM's rule)."""

    def __init__(self, words: list[list[int]]):
        self.single = sorted({w[0] for w in words if len(w) == 1})
        self.longer = [w for w in words if len(w) > 1]

    def contribute(self, step, row, seq, offset):
        banned = list(self.single)
        if self.longer:
            out = seq.completion_token_ids
            banned += [w[-1] for w in self.longer if out[len(out) - len(w) + 1 :] == w[:-1]]
            row_extras(step).sync = True  # the next step needs this step's token on the host
        if banned:
            row_extras(step).add("suppressed", row, banned)


def truncates(sp) -> bool:
    """top-k, top-p or min-p on a drawn row."""
    return not sp.is_greedy and (sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0)


class Logprobs(RequestProcessor):
    def __init__(self, num: int):
        self.num = num

    def contribute(self, step, row, seq, offset):
        row_extras(step).set("logprobs", row, self.num)

    def report(self, seq, out, extra):
        if extra is not None and "logprobs" in extra:
            out.new_logprobs = [extra["logprobs"]]
