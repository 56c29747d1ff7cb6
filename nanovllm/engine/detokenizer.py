"""A completion's text, token by token: for stop strings and streaming (pure Python; any Hugging
Face tokenizer)."""


class IncrementalDetokenizer:
    """Decodes each new token in a small window of the tokens before it, so a character split over
    several tokens appears once whole, never as half a multi-byte sequence; finds stop strings
    across token boundaries; and tells a stream which text it may already hand out.

    ``text`` is everything decoded so far (only whole characters). Once a stop string is found,
    ``stopped_text`` is the final text: ``text`` cut before the stop string, or after it with
    ``include_stop_str_in_output``.
    """

    def __init__(
        self,
        tokenizer,
        stop: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
    ):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.num_text_tokens = 0
        self.text = ""
        self.stopped_text: str | None = None
        self._window_start = 0  # tokens before this are decoded and their text final
        self._read = 0  # tokens before this are in ``text``
        # a stream holds back this many characters: they may yet begin a stop string
        self.hold_back = max(map(len, stop), default=1) - 1
        self.sent_text = 0  # characters and tokens a stream has handed out
        self.sent_tokens = 0
        self.sent_final = (
            False  # the stream has handed out the finished completion's last increment
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(
        self, token_ids: list[int], check_stop: bool = True, hide_last: bool = False
    ) -> str | None:
        """Take the completion's new tokens; returns the stop string that ends it, if one appears
        in the new text (and ``check_stop``). ``hide_last``: the last token (an EOS or stop id that
        ended the completion) is left out of the text."""
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

    def final_text(self) -> str:
        """The completion's text once it has finished."""
        if self.stopped_text is not None:
            return self.stopped_text
        return self._decode(self.token_ids[: self.num_text_tokens])

    def take_increment(self, finished: bool) -> tuple[list[int], str]:
        """The tokens and text a stream has not handed out yet: while running, all but the last
        ``hold_back`` characters; when finished, up to the end of ``final_text()``."""
        self.sent_final = finished
        ids = self.token_ids[self.sent_tokens :]
        self.sent_tokens = len(self.token_ids)
        text = (
            self.final_text()
            if finished
            else self.text[: max(self.sent_text, len(self.text) - self.hold_back)]
        )
        new_text = text[self.sent_text :]
        self.sent_text = len(text)
        return ids, new_text
