"""One token per row: a plain batch draws here (``draw``), any other through ``extras``."""

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.sampling.draw import plain_draw


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    seeds: torch.Tensor | None  # [B] int64 draw seeds in [0, 2**32); None when all are greedy
    all_greedy: bool
    suppress: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, token id) pairs to -inf
    bias: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # pairs, values
    penalties: object | None = None  # extras.Penalties
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [G], [G, words] int32)
    filters: object | None = None  # extras.Filters
    logprob_rows: torch.Tensor | None = None  # [L] int64: rows that return log-probabilities
    num_logprobs: int = 0  # top tokens returned for each of them

    @property
    def plain(self) -> bool:
        extras = (self.suppress, self.bias, self.penalties, self.token_bitmask, self.filters)
        return extras == (None,) * 5 and self.logprob_rows is None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # for ``logprob_rows``: the sampled token's logprob [L], the top [L, num], ids, its rank [L]
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def make_sampling_batch(rows, vocab_size: int, to_device) -> SamplingBatch:
    """A step's ``SamplingRows`` as tensors (``to_device(values, dtype)``)."""
    all_greedy = not any(rows.temperatures)
    seeds = None if all_greedy else to_device(rows.seeds, torch.int64)
    batch = SamplingBatch(to_device(rows.temperatures, torch.float32), seeds, all_greedy)
    if rows.extra is not None:
        from nanovllm.sampling.extras import add_extras

        add_extras(batch, rows.extra, vocab_size, to_device)
    return batch


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if not batch.plain:
            from nanovllm.sampling.extras import sample

            return SamplerOutput(*sample(logits, batch))
        if batch.all_greedy:
            return SamplerOutput(logits.argmax(dim=-1))
        return SamplerOutput(plain_draw(logits, batch.temperatures, batch.seeds))
