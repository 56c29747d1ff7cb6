"""The sampler's full path (vLLM's order: suppression, penalties, grammar mask, then the draw
with min-p, top-k, top-p), and the tensors a step's ``RowExtras`` become."""

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.sampling import torch_ops
from nanovllm.sampling.draw import plain_draw

# a top-p or min-p row without top-k first looks at this many most likely tokens; only when its
# kept set reaches past them is the whole vocabulary sorted
NUM_CANDIDATES = 512


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


def _used(values: list | None) -> list[int]:
    return [] if values is None else [i for i, v in enumerate(values) if v is not None]


def add_extras(batch, extra, vocab_size: int, to_device) -> None:
    pairs = [(i, t) for i in _used(extra.suppressed) for t in extra.suppressed[i] if t < vocab_size]
    if pairs:
        rows, ids = zip(*pairs)
        batch.suppress = (to_device(list(rows), torch.int64), to_device(list(ids), torch.int64))
    if rows := _used(extra.bias):
        rows, ids, values = zip(*[(i, t, b) for i in rows for t, b in zip(*extra.bias[i])])
        index = (to_device(list(rows), torch.int64), to_device(list(ids), torch.int64))
        batch.bias = (index, to_device(list(values), torch.float32))  # ids checked: in the vocab
    if rows := _used(extra.penalties):
        batch.penalties = _penalties([extra.penalties[i] for i in rows], rows, to_device)
    if rows := _used(extra.filters):
        batch.filters = _filters([extra.filters[i] for i in rows], rows, vocab_size, to_device)
    if extra.bitmask_rows:
        width = max(m.shape[1] for m in extra.bitmasks)  # zero words past a mask: not allowed
        padded = [np.pad(m, ((0, 0), (0, width - m.shape[1]))) for m in extra.bitmasks]
        bitmask = np.concatenate(padded)
        rows = to_device(extra.bitmask_rows, torch.int64)
        batch.token_bitmask = (rows, to_device(bitmask, torch.int32))
    if rows := _used(extra.logprobs):
        batch.logprob_rows = to_device(rows, torch.int64)
        batch.num_logprobs = min(vocab_size, max(extra.logprobs[i] for i in rows))


def _penalties(values: list, rows: list[int], to_device) -> Penalties:
    prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], []
    for j, (_, _, _, prompt, output) in enumerate(values):
        prompt_rows += [j] * len(prompt)
        prompt_ids += prompt
        output_rows += [j] * len(output)
        output_ids += output
    repetition, presence, frequency = ([v[k] for v in values] for k in range(3))
    return Penalties(
        rows=to_device(rows, torch.int64),
        repetition=to_device(repetition, torch.float32),
        presence=to_device(presence, torch.float32),
        frequency=to_device(frequency, torch.float32),
        prompt_tokens=(to_device(prompt_rows, torch.int64), to_device(prompt_ids, torch.int64)),
        output_tokens=(to_device(output_rows, torch.int64), to_device(output_ids, torch.int64)),
    )


def _filters(values: list, rows: list[int], vocab_size: int, to_device) -> Filters:
    top_k = [min(k, vocab_size) for k, _, _ in values]
    all_top_k = all(top_k)
    num_candidates = max(top_k) if all_top_k else max(NUM_CANDIDATES, *top_k)
    min_p = [m for _, _, m in values]
    return Filters(
        rows=to_device(rows, torch.int64),
        top_k=to_device(top_k, torch.int64),
        top_p=to_device([p for _, p, _ in values], torch.float32),
        min_p=to_device(min_p, torch.float32) if any(min_p) else None,
        num_candidates=min(num_candidates, vocab_size),
        all_top_k=all_top_k,
    )


def sample(logits: torch.Tensor, batch) -> tuple:
    """Token ids [B] and the logprobs of a ``batch`` that is not plain."""
    raw = logits
    shaping = (batch.suppress, batch.bias, batch.penalties, batch.token_bitmask)
    if shaping != (None,) * 4:
        logits = logits.to(torch.float32, copy=True)  # never modify the raw logits in place
        if batch.suppress is not None:
            logits[batch.suppress] = float("-inf")
        if batch.bias is not None:
            logits.index_put_(*batch.bias, accumulate=True)
        if (p := batch.penalties) is not None:
            args = (p.repetition, p.presence, p.frequency, p.prompt_tokens, p.output_tokens)
            torch_ops.apply_penalties(logits, p.rows, *args)
        if batch.token_bitmask is not None:
            torch_ops.apply_token_bitmask(logits, *batch.token_bitmask)
    f = batch.filters
    if batch.all_greedy:
        token_ids = logits.argmax(dim=-1)
    elif f is None:
        token_ids = plain_draw(logits, batch.temperatures, batch.seeds)
    else:
        settings = (f.top_k, f.top_p, f.min_p, f.num_candidates, f.all_top_k)
        if f.rows.numel() == logits.size(0):  # every row filters: no pass over the vocabulary
            token_ids = torch_ops.sample_filtered(
                logits, batch.temperatures, batch.seeds, *settings
            )
        else:
            token_ids = plain_draw(logits, batch.temperatures, batch.seeds)
            temperatures, seeds = batch.temperatures[f.rows], batch.seeds[f.rows]
            filtered = torch_ops.sample_filtered(logits[f.rows], temperatures, seeds, *settings)
            token_ids[f.rows] = filtered
    logprobs = None
    if batch.logprob_rows is not None:
        rows = batch.logprob_rows
        logprobs = torch_ops.top_logprobs(raw[rows], token_ids[rows], batch.num_logprobs)
    return token_ids, logprobs


def _to_host(tensors) -> list | None:
    return None if tensors is None else [t.to("cpu", non_blocking=True) for t in tensors]


class ExtraOutputs:
    """A step's log-probabilities on their way to the host."""

    def __init__(self, out, extra, scoring, prompt):
        self.num_logprobs = None if extra is None else extra.logprobs
        self.logprobs = _to_host(out.logprobs)
        self.scoring, self.prompt = scoring, _to_host(prompt)

    def rows(self, token_ids: list[int]) -> list[dict | None]:
        """Per row: ``{"logprobs": (logprob, {token_id: (logprob, rank)})}`` and
        ``{"prompt_logprobs": (its first scored position, [{token_id: (logprob, rank)}, ...])}``,
        or None."""
        out = [None] * len(token_ids)
        if self.logprobs is not None:
            sampled, top_values, top_ids, ranks = (t.tolist() for t in self.logprobs)
            rows = _used(self.num_logprobs)
            for i, lp, values, ids, rank in zip(rows, sampled, top_values, top_ids, ranks):
                entry = _entry(token_ids[i], lp, rank, ids, values, self.num_logprobs[i])
                out[i] = {"logprobs": (lp, entry)}
        if self.prompt is not None:
            scored, top_values, top_ids, ranks = (t.tolist() for t in self.prompt)
            s, j = self.scoring, 0
            for row, first, count, n in zip(s.rows, s.firsts, s.counts, s.nums):
                entries = []
                for k in range(j, j + count):
                    args = (top_ids[k], top_values[k], n)
                    entries.append(_entry(s.targets[k], scored[k], ranks[k], *args))
                out[row] = {**(out[row] or {}), "prompt_logprobs": (first, entries)}
                j += count
        return out


def _entry(token: int, logprob: float, rank: int, ids: list, values: list, n: int) -> dict:
    # vLLM's order: the chosen token first, then the top n; a top token's rank is its place
    entry = {token: (logprob, rank)}
    entry.update((t, (v, r)) for r, (t, v) in enumerate(zip(ids[:n], values[:n]), 1))
    return entry


def heaviest_sampling(num_rows: int, vocab_size: int):
    """Rows on the sampler's heaviest path, every extra on every row (memory sizing)."""
    from nanovllm.engine.step import SamplingRows
    from nanovllm.features.processors import RowExtras

    every = np.full((1, -(-vocab_size // 32)), -1, dtype=np.int32)  # every token allowed
    extra = RowExtras(num_rows, suppressed=[[0]] * num_rows, bias=[([0], [0.5])] * num_rows)
    extra.penalties = [(1.1, 0.5, 0.0, [0] * 8, [])] * num_rows
    extra.filters, extra.logprobs = [(0, 0.9, 0.0)] * num_rows, [20] * num_rows
    extra.bitmask_rows, extra.bitmasks = list(range(num_rows)), [every] * num_rows
    return SamplingRows([1.0] * num_rows, list(range(num_rows)), extra)
