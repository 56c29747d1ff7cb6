"""A step's sampling rows (``engine.step.SamplingRows``, plain lists) as the sampler's tensors (rank 0).

A setting nobody in the batch uses adds no tensor and no work.
"""

from collections.abc import Callable

import numpy as np
import torch

from nanovllm.sampling.sampler import Filters, Penalties, SamplingBatch

# a top-p or min-p row without top-k first looks at this many most likely tokens; only when its
# kept set reaches past them is the whole vocabulary sorted
NUM_CANDIDATES = 512

ToDevice = Callable[
    [list | np.ndarray, torch.dtype], torch.Tensor
]  # host data to a tensor on the rank's device


def make_sampling_batch(rows, vocab_size: int, to_device: ToDevice) -> SamplingBatch:
    all_greedy = not any(rows.temperatures)
    batch = SamplingBatch(
        to_device(rows.temperatures, torch.float32),
        None if all_greedy else to_device(rows.seeds, torch.int64),
        all_greedy,
    )
    if rows.plain:
        return batch
    params = rows.params
    if rows.suppressed is not None:
        pairs = [(i, t) for i, ids in enumerate(rows.suppressed) for t in ids if t < vocab_size]
        if pairs:
            suppress_rows, ids = zip(*pairs)
            batch.suppress = (
                to_device(list(suppress_rows), torch.int64),
                to_device(list(ids), torch.int64),
            )
    if rows.penalty_tokens is not None:
        penalised = [i for i, tokens in enumerate(rows.penalty_tokens) if tokens is not None]
        batch.penalties = _penalties(rows.penalty_tokens, penalised, params, to_device)
    filtered = [i for i, (p, t) in enumerate(zip(params, rows.temperatures)) if t and p.has_filters]
    if filtered:
        batch.filters = _filters([params[i] for i in filtered], filtered, vocab_size, to_device)
    if rows.token_bitmask is not None:
        grammar_rows, bitmask = rows.token_bitmask
        batch.token_bitmask = (
            to_device(grammar_rows, torch.int64),
            to_device(bitmask, torch.int32),
        )
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if logprob_rows:
        batch.logprob_rows = to_device(logprob_rows, torch.int64)
        batch.num_logprobs = min(vocab_size, max(params[i].logprobs for i in logprob_rows))
    return batch


def _penalties(tokens: list, rows: list[int], params: list, to_device: ToDevice) -> Penalties:
    prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], []
    for j, i in enumerate(rows):
        prompt, output = tokens[i]
        prompt_rows += [j] * len(prompt)
        prompt_ids += prompt
        output_rows += [j] * len(output)
        output_ids += output
    params = [params[i] for i in rows]
    return Penalties(
        rows=to_device(rows, torch.int64),
        repetition=to_device([p.repetition_penalty for p in params], torch.float32),
        presence=to_device([p.presence_penalty for p in params], torch.float32),
        frequency=to_device([p.frequency_penalty for p in params], torch.float32),
        prompt_tokens=(to_device(prompt_rows, torch.int64), to_device(prompt_ids, torch.int64)),
        output_tokens=(to_device(output_rows, torch.int64), to_device(output_ids, torch.int64)),
    )


def _filters(params: list, rows: list[int], vocab_size: int, to_device: ToDevice) -> Filters:
    top_k = [min(p.top_k, vocab_size) for p in params]
    all_top_k = all(top_k)
    num_candidates = max(top_k) if all_top_k else max(NUM_CANDIDATES, *top_k)
    return Filters(
        rows=to_device(rows, torch.int64),
        top_k=to_device(top_k, torch.int64),
        top_p=to_device([p.top_p for p in params], torch.float32),
        min_p=to_device([p.min_p for p in params], torch.float32)
        if any(p.min_p for p in params)
        else None,
        num_candidates=min(num_candidates, vocab_size),
        all_top_k=all_top_k,
    )
