"""Request processors that shape a row's sampling (docs/features.md)."""

from nanovllm.features.processors import RequestProcessor, row_extras


class MinTokens(RequestProcessor):
    def __init__(self, min_tokens: int, token_ids: list[int]):
        self.min_tokens, self.token_ids = min_tokens, token_ids

    def contribute(self, step, row, seq, offset):
        if seq.num_completion_tokens < self.min_tokens:
            row_extras(step).set("suppressed", row, self.token_ids)


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


class Logprobs(RequestProcessor):
    def __init__(self, num: int):
        self.num = num

    def contribute(self, step, row, seq, offset):
        row_extras(step).set("logprobs", row, self.num)

    def report(self, seq, out, extra):
        if extra is not None and "logprobs" in extra:
            out.new_logprobs = [extra["logprobs"]]
