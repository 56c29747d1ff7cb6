"""A launched step's sampled tokens on their way to the host (rank 0): copied from the device
without blocking, and read when the engine resolves the step, which may be one step later."""

from collections.abc import Callable

import torch

from nanovllm.sampling import SamplerOutput


class StepOutput:
    def __init__(
        self,
        out: SamplerOutput,
        num_logprobs: list[int | None] | None,
        wait: Callable[[torch.cuda.Event], None],
        scoring=None,
        prompt: tuple | None = None,
    ):
        """``num_logprobs``: each row's ``logprobs`` setting (when any row asked for them). ``wait``
        blocks until an event has passed on the device (and may raise when a rank died).
        ``scoring`` (``engine.step.PromptScoring``) and ``prompt``: the prompt tokens the step
        scored, and their log-probabilities (``sampling.prompt_logprobs.score_prompt``)."""
        self.num_logprobs = num_logprobs
        self.device_token_ids = out.token_ids
        self.token_ids = out.token_ids.to("cpu", non_blocking=True)
        self.logprobs = (
            None if out.logprobs is None else [t.to("cpu", non_blocking=True) for t in out.logprobs]
        )
        self.scoring = scoring
        self.prompt = None if prompt is None else [t.to("cpu", non_blocking=True) for t in prompt]
        self.ready = None
        self.wait = wait
        if out.token_ids.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()

    def result(self) -> tuple[list[int], list | None, dict | None]:
        """One sampled token id per sequence; (when any sequence asked for them) one
        ``(logprob, {token_id: logprob})`` or None per sequence; and (when the step scored prompt
        tokens) ``{row: (position of its first scored token, [{token_id: logprob}, ...])}``."""
        if self.ready is not None:
            self.wait(self.ready)
            self.ready = None
        token_ids = self.token_ids.tolist()
        return token_ids, self._logprobs(token_ids), self._prompt_logprobs()

    def _logprobs(self, token_ids: list[int]) -> list | None:
        if self.logprobs is None:
            return None
        logprobs = [None] * len(token_ids)
        sampled, top_values, top_ids = (t.tolist() for t in self.logprobs)
        rows = (i for i, n in enumerate(self.num_logprobs) if n is not None)
        for i, lp, values, ids in zip(rows, sampled, top_values, top_ids):
            n = self.num_logprobs[i]
            entry = dict(zip(ids[:n], values[:n]))
            entry[token_ids[i]] = lp
            logprobs[i] = (lp, entry)
        return logprobs

    def _prompt_logprobs(self) -> dict | None:
        if self.prompt is None:
            return None
        scored, top_values, top_ids = (t.tolist() for t in self.prompt)
        s = self.scoring
        out, i = {}, 0
        for row, first, count, n in zip(s.rows, s.firsts, s.counts, s.nums):
            entries = []
            for j in range(i, i + count):
                entry = dict(zip(top_ids[j][:n], top_values[j][:n]))
                entry[s.targets[j]] = scored[j]
                entries.append(entry)
            out[row] = (first, entries)
            i += count
        return out
