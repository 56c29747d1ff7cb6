"""A launched step's sampled tokens on their way to the host (rank 0): copied from the device
without blocking, and read when the engine resolves the step, which may be one step later."""
from collections.abc import Callable

import torch

from nanovllm.sampling import SamplerOutput


class StepOutput:
    def __init__(self, out: SamplerOutput, num_logprobs: list[int | None] | None,
                 wait: Callable[[torch.cuda.Event], None]):
        """``num_logprobs``: each row's ``logprobs`` setting (when any row asked for them). ``wait``
        blocks until an event has passed on the device (and may raise when a rank died)."""
        self.num_logprobs = num_logprobs
        self.device_token_ids = out.token_ids
        self.token_ids = out.token_ids.to("cpu", non_blocking=True)
        self.logprobs = None if out.logprobs is None else [t.to("cpu", non_blocking=True) for t in out.logprobs]
        self.ready = None
        self.wait = wait
        if out.token_ids.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()

    def result(self) -> tuple[list[int], list | None]:
        """One sampled token id per sequence, and (when any sequence asked for them) one
        ``(logprob, {token_id: logprob})`` or None per sequence."""
        if self.ready is not None:
            self.wait(self.ready)
            self.ready = None
        token_ids = self.token_ids.tolist()
        if self.logprobs is None:
            return token_ids, None
        logprobs = [None] * len(token_ids)
        sampled, top_values, top_ids = (t.tolist() for t in self.logprobs)
        rows = (i for i, n in enumerate(self.num_logprobs) if n is not None)
        for i, lp, values, ids in zip(rows, sampled, top_values, top_ids):
            n = self.num_logprobs[i]
            entry = dict(zip(ids[:n], values[:n]))
            entry[token_ids[i]] = lp
            logprobs[i] = (lp, entry)
        return token_ids, logprobs
