"""A launched step's token ids on rank 0, copied to the host without blocking."""

from collections.abc import Callable

import torch


class StepOutput:
    """``host``: the tokens' host copy, written by the queued work (a decode graph), if any; it is
    read by ``result``, or copied by ``keep`` before that work is queued again."""

    def __init__(self, token_ids: torch.Tensor, wait: Callable, extra=None, host=None):
        self.device_token_ids = token_ids
        self.token_ids = token_ids.to("cpu", non_blocking=True) if host is None else host
        self.extra = extra  # sampling.extras.ExtraOutputs: log-probabilities, copies queued
        self.wait = wait  # wait(event): until it has passed (may raise when a rank died)
        self.ready = None
        if token_ids.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()

    def keep(self) -> None:
        if self.ready is not None:
            self.wait(self.ready)
            self.ready = None
            self.token_ids = self.token_ids.clone()

    def result(self) -> tuple[list[int], list[dict | None] | None]:
        if self.ready is not None:
            self.wait(self.ready)
            self.ready = None
        token_ids = self.token_ids.tolist()
        return token_ids, None if self.extra is None else self.extra.rows(token_ids)
