"""A completion's text token by token, for stop strings and streams (docs/frontend.md)."""

from nanovllm.logprobs import ranked


class IncrementalDetokenizer:
    def __init__(self, tokenizer, sampling_params):
        sp = sampling_params
        self.tokenizer = tokenizer
        self.stop = sp.stop
        self.include_stop = sp.include_stop_str_in_output
        self.skip_special_tokens = sp.skip_special_tokens
        self.detokenize = sp.detokenize  # False: no text at all (and no stop strings)
        self.token_ids: list[int] = []
        self.num_text_tokens = 0
        self.text = ""
        self.stopped_text: str | None = None
        self._window_start = 0  # tokens before this are decoded and their text final
        self._read = 0  # tokens before this are in ``text``
        self.hold_back = max(map(len, self.stop), default=1) - 1  # may yet begin a stop string
        self.sent_text = self.sent_tokens = 0  # characters and tokens a stream has handed out
        self.sent_final = False  # a stream has handed out the finished completion's last increment

    def _decode(self, ids: list[int]) -> str:
        if not self.detokenize:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int], check_stop=True, hide_last=False) -> str | None:
        """The stop string in the new text, if any; ``hide_last``: the last token is not text."""
        self.token_ids += token_ids
        self.num_text_tokens = len(self.token_ids) - hide_last
        text_ids = self.token_ids[: self.num_text_tokens]
        before = self._decode(text_ids[self._window_start : self._read])
        window = self._decode(text_ids[self._window_start :])
        if window.endswith("\ufffd"):  # a character still incomplete: wait for its next bytes
            return None
        new_text = window[len(before) :]
        self._window_start, self._read = self._read, len(text_ids)
        start = len(self.text)
        self.text += new_text
        if not (check_stop and self.stop and new_text):
            return None
        found = None
        for s in self.stop:  # the earliest stop string wins
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i != -1 and (found is None or i < found[0]):
                found = (i, s)
        if found is None:
            return None
        i, s = found
        self.stopped_text = self.text[: i + len(s) if self.include_stop else i]
        return s

    def stop_string(self, c, new_token_ids: list[int]) -> bool:
        """Whether a stop string ends completion ``c`` (counted after ``min_tokens``)."""
        check = c.finish_reason in (None, "length") and len(c.token_ids) > c.params.min_tokens
        stop = self.add_tokens(new_token_ids, check, c.num_text_tokens < len(c.token_ids))
        if stop is None:
            return False
        c.finish_reason, c.stop_reason = "stop", stop
        return True

    def final_text(self) -> str:
        if self.stopped_text is not None:
            return self.stopped_text
        return self._decode(self.token_ids[: self.num_text_tokens])

    def take_increment(self, finished: bool) -> tuple[list[int], str]:
        self.sent_final = finished
        ids = self.token_ids[self.sent_tokens :]
        self.sent_tokens = len(self.token_ids)
        if finished:
            text = self.final_text()
        else:
            text = self.text[: max(self.sent_text, len(self.text) - self.hold_back)]
        new_text = text[self.sent_text :]
        self.sent_text = len(text)
        return ids, new_text


def increments(request) -> list[tuple[int, dict]]:
    """A stream's new output of each completion, ``(index, dict)``."""
    out = []
    for i, c in enumerate(request.completions):
        d = c.detokenizer
        if d.sent_final or (d.sent_tokens == len(d.token_ids) and not c.finished):
            continue  # done, or nothing new
        start = d.sent_tokens
        token_ids, text = d.take_increment(c.finished)
        tokenizer = d.tokenizer if d.detokenize else None
        logprobs = ranked(c.logprobs and c.logprobs[start : start + len(token_ids)], tokenizer)
        inc = {
            "token_ids": token_ids,
            "text": text,
            "finished": c.finished,
            "logprobs": logprobs,
            "prompt_logprobs": None,
        }
        if i == 0 and not request.prompt_logprobs_sent:
            inc["prompt_logprobs"] = ranked(request.prompt_logprobs, tokenizer)
            request.prompt_logprobs_sent = True
        if c.finished:
            inc["finish_reason"], inc["stop_reason"] = c.finish_reason, c.stop_reason
        out.append((i, inc))
    return out
