"""Turn a step's sequences into the sampler's per-row tensors (rank 0 only).

One pass over the sequences; a setting nobody in the batch uses adds no tensor and no work.
"""
import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import ToDevice
from nanovllm.layers.sampler import Filters, Penalties, SamplingBatch

# a top-p or min-p row without top-k first looks at this many most likely tokens; only when its
# kept set reaches past them is the whole vocabulary sorted
NUM_CANDIDATES = 512
_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, step: int) -> int:
    """The 32-bit noise seed of a seeded request's ``step``-th token (a splitmix64 finaliser of
    both): the draw depends on nothing else, so the batch around it does not change it."""
    x = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & 0xFFFFFFFF


def plain_sampling(seqs: list[Sequence], rng: np.random.Generator) -> tuple[list[float], list[int]] | None:
    """(temperatures, seeds) when every row samples with a temperature (0: greedy) and a seed
    alone, as the fused draw does on its own; None when any row needs more of the sampler (filters,
    penalties, min_tokens suppression, logprobs). Unseeded rows get seeds from ``rng``."""
    temperatures, seeds = [], rng.integers(0, 1 << 32, len(seqs)).tolist()
    for i, seq in enumerate(seqs):
        sp = seq.sampling_params
        if sp.has_filters or sp.has_penalties or sp.logprobs is not None or seq.num_completion_tokens < sp.min_tokens:
            return None
        temperatures.append(0.0 if sp.is_greedy else sp.temperature)
        if sp.seed is not None:
            seeds[i] = draw_seed(sp.seed, seq.num_completion_tokens)
    return temperatures, seeds


def make_sampling_batch(
    seqs: list[Sequence], vocab_size: int, device: torch.device, to_device: ToDevice
) -> SamplingBatch:
    temperatures, seeded, seed_values, filtered, penalised, suppress, logprob_rows = [], [], [], [], [], [], []
    for i, seq in enumerate(seqs):
        sp = seq.sampling_params
        temperatures.append(0.0 if sp.is_greedy else sp.temperature)
        if not sp.is_greedy:
            if sp.seed is not None:
                seeded.append(i)
                seed_values.append(draw_seed(sp.seed, seq.num_completion_tokens))
            if sp.has_filters:
                filtered.append(i)
        if sp.has_penalties:
            penalised.append(i)
        if seq.num_completion_tokens < sp.min_tokens:
            suppress += [(i, t) for t in seq.min_tokens_ids if t < vocab_size]
        if sp.logprobs is not None:
            logprob_rows.append(i)

    all_greedy = not any(temperatures)
    batch = SamplingBatch(to_device(temperatures, torch.float32), None, all_greedy)
    if not all_greedy:
        batch.seeds = torch.randint(0, 1 << 32, (len(seqs),), dtype=torch.int64, device=device)
        if seeded:
            batch.seeds[to_device(seeded, torch.int64)] = to_device(seed_values, torch.int64)
    if suppress:
        rows, ids = zip(*suppress)
        batch.suppress = (to_device(list(rows), torch.int64), to_device(list(ids), torch.int64))
    if penalised:
        batch.penalties = _penalties([seqs[i] for i in penalised], penalised, to_device)
    if filtered:
        batch.filters = _filters([seqs[i].sampling_params for i in filtered], filtered, vocab_size, to_device)
    if logprob_rows:
        batch.logprob_rows = to_device(logprob_rows, torch.int64)
        batch.num_logprobs = min(vocab_size, max(seqs[i].sampling_params.logprobs for i in logprob_rows))
    return batch


def _penalties(seqs: list[Sequence], rows: list[int], to_device: ToDevice) -> Penalties:
    prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], []
    for j, seq in enumerate(seqs):
        prompt, output = seq.prompt_token_ids, seq.completion_token_ids
        prompt_rows += [j] * len(prompt)
        prompt_ids += prompt
        output_rows += [j] * len(output)
        output_ids += output
    params = [seq.sampling_params for seq in seqs]
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
        min_p=to_device([p.min_p for p in params], torch.float32) if any(p.min_p for p in params) else None,
        num_candidates=min(num_candidates, vocab_size),
        all_top_k=all_top_k,
    )
