"""The sampler: one token per row from the logits, with each row's own settings as tensors.

Order, as in vLLM: min_tokens suppression, penalties, the grammar's token mask, then greedy argmax or temperature, min-p,
top-k, top-p and the draw. Rows that use none of these pay nothing for them: the plain
temperature draw is one fused pass on the GPU (``triton_draw``) and an inverse-CDF draw on the
CPU (``torch_ops.cdf_draw``); log-probabilities come from the raw logits, before any of it.
"""

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.sampling import torch_ops


@dataclass
class Penalties:
    rows: torch.Tensor  # [P] int64: the penalised rows
    repetition: torch.Tensor  # [P] float32
    presence: torch.Tensor
    frequency: torch.Tensor
    prompt_tokens: tuple[torch.Tensor, torch.Tensor]  # (index into rows, token id) per prompt token
    output_tokens: tuple[torch.Tensor, torch.Tensor]  # the same per output token


@dataclass
class Filters:
    rows: torch.Tensor  # [R] int64: the rows that sample with top-k, top-p or min-p
    top_k: torch.Tensor  # [R] int64, 0 = off
    top_p: torch.Tensor  # [R] float32, 1 = off
    min_p: torch.Tensor | None  # [R] float32, or None when no row uses min-p
    num_candidates: int  # tokens considered per row before the vocabulary is needed
    all_top_k: bool  # every row has top-k: the candidates always suffice


@dataclass
class SamplingBatch:
    """One step's sampling settings, one row per sequence (built by ``batch.make_sampling_batch``)."""

    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    seeds: torch.Tensor | None  # [B] int64 draw seeds in [0, 2**32); None when every row is greedy
    all_greedy: bool
    suppress: tuple[torch.Tensor, torch.Tensor] | None = (
        None  # (row, token id) pairs masked to -inf
    )
    penalties: Penalties | None = None
    # (rows [G] int64, bitmask [G, words] int32): tokens a row's grammar does not allow are masked
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
    filters: Filters | None = None
    logprob_rows: torch.Tensor | None = None  # [L] int64: rows that return log-probabilities
    num_logprobs: int = 0  # top tokens returned for each of them


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # for ``logprob_rows``: the sampled token's logprob [L], the top ones [L, num] and their ids
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _plain_draw(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """The temperature draw of every row (T = 0: argmax): the fused Gumbel-max kernel on the GPU,
    the inverse-CDF draw on the CPU (the per-token noise would cost twenty passes there)."""
    if logits.is_cuda:
        from nanovllm.sampling.triton_draw import gumbel_argmax

        return gumbel_argmax(logits, temperatures, seeds)
    return torch_ops.cdf_draw(logits, temperatures, seeds)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits
        if (
            batch.suppress is not None
            or batch.penalties is not None
            or batch.token_bitmask is not None
        ):
            logits = logits.to(torch.float32, copy=True)  # never modify the raw logits in place
            if batch.suppress is not None:
                logits[batch.suppress] = float("-inf")
            if (p := batch.penalties) is not None:
                torch_ops.apply_penalties(
                    logits,
                    p.rows,
                    p.repetition,
                    p.presence,
                    p.frequency,
                    p.prompt_tokens,
                    p.output_tokens,
                )
            if batch.token_bitmask is not None:
                torch_ops.apply_token_bitmask(logits, *batch.token_bitmask)
        if batch.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            f = batch.filters
            if f is None:
                token_ids = _plain_draw(logits, batch.temperatures, batch.seeds)
            elif f.rows.numel() == logits.size(
                0
            ):  # every row filters: no pass over the full vocabulary
                token_ids = torch_ops.sample_filtered(
                    logits,
                    batch.temperatures,
                    batch.seeds,
                    f.top_k,
                    f.top_p,
                    f.min_p,
                    f.num_candidates,
                    f.all_top_k,
                )
            else:
                token_ids = _plain_draw(logits, batch.temperatures, batch.seeds)
                token_ids[f.rows] = torch_ops.sample_filtered(
                    logits[f.rows],
                    batch.temperatures[f.rows],
                    batch.seeds[f.rows],
                    f.top_k,
                    f.top_p,
                    f.min_p,
                    f.num_candidates,
                    f.all_top_k,
                )
        logprobs = None
        if batch.logprob_rows is not None:
            rows = batch.logprob_rows
            logprobs = torch_ops.top_logprobs(raw[rows], token_ids[rows], batch.num_logprobs)
        return SamplerOutput(token_ids, logprobs)
