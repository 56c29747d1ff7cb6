"""Penalties against a per-row Python loop, greedy draws after penalties and suppression,
and log-probabilities against float64 log_softmax (from the raw logits).
"""

from collections import Counter

import torch
from sampling_helpers import sample_seqs, seq_with

from nanovllm.sampling import torch_ops
from nanovllm.sampling_params import SamplingParams

# ---- penalties -----------------------------------------------------------------------------------


def penalised_reference(
    row: list[float],
    prompt: list[int],
    output: list[int],
    repetition: float,
    presence: float,
    frequency: float,
) -> list[float]:
    out = list(row)
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t, count in Counter(output).items():
        out[t] -= frequency * count + presence
    return out


PENALISED = {  # row -> (prompt, output, repetition, presence, frequency)
    0: ([3, 3, 7, 11, 0], [7, 7, 7, 20, 3], 1.3, 0.5, 0.25),
    2: (
        [1, 2, 2, 5],
        [],
        0.7,
        0.0,
        0.0,
    ),  # repetition < 1 raises the prompt's tokens; no output yet
    3: ([9], [4, 4, 9, 31, 31, 31, 31], 1.0, -0.4, 1.5),  # presence/frequency only, one negative
    5: ([31, 30], [30, 12], 2.0, 2.0, -2.0),
}


def occurrences(token_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into the penalised rows, token id), one pair per token occurrence."""
    index = [j for j, tokens in enumerate(token_lists) for _ in tokens]
    ids = [t for tokens in token_lists for t in tokens]
    return torch.tensor(index, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)


def test_apply_penalties_matches_loop():
    """Rows 1, 4 and 6 are not penalised and must stay bit for bit; the others as the loop says."""
    g = torch.Generator().manual_seed(13)
    logits = 3.0 * torch.randn(7, 32, generator=g)  # both signs
    logits[0, 7], logits[0, 3], logits[5, 30] = -2.5, 1.75, 0.0
    original = logits.clone()
    settings = list(PENALISED.values())
    torch_ops.apply_penalties(
        logits,
        torch.tensor(list(PENALISED)),
        *(torch.tensor([s[i] for s in settings]) for i in (2, 3, 4)),
        occurrences([s[0] for s in settings]),
        occurrences([s[1] for s in settings]),
    )
    for i in range(logits.size(0)):
        if i not in PENALISED:
            assert torch.equal(logits[i], original[i]), f"row {i} is not penalised but changed"
            continue
        want = torch.tensor(
            penalised_reference(original[i].double().tolist(), *PENALISED[i]), dtype=torch.float64
        )
        err = (logits[i].double() - want).abs()
        assert err.max() < 1e-5, (
            f"row {i}, {PENALISED[i]}: tokens {torch.nonzero(err >= 1e-5).flatten().tolist()} are "
            f"{logits[i][err >= 1e-5].tolist()}, want {want[err >= 1e-5].tolist()}"
        )


def test_sampler_greedy_after_penalties_and_suppression():
    """Greedy rows take the argmax of the penalised logits, with the min_tokens ids masked (the
    reference's argmax is each time a token the penalty or the suppression moved)."""
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(3, 64, generator=g)
    logits[0, 5], logits[0, 6] = 4.0, 3.0  # 5 is in the output, penalised below 6
    logits[1, 9], logits[1, 8] = 5.0, 4.5  # 9 is EOS, suppressed below min_tokens
    logits[2, 9], logits[2, 8] = 5.0, 4.5  # min_tokens reached: no longer suppressed
    seqs = [
        seq_with(
            SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5),
            prompt=[1, 5],
        ),
        seq_with(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]), 1),
        seq_with(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]), 2),
    ]
    for _ in range(2):
        seqs[0].append_placeholder(-1)
        seqs[0].set_token(len(seqs[0]) - 1, 5)
    want = [6, 8, 9]
    reference_row = penalised_reference(logits[0].tolist(), [1, 5], [5, 5], 1.0, 0.5, 1.0)
    assert max(range(64), key=reference_row.__getitem__) == want[0]
    out = sample_seqs(seqs, logits)
    assert out.token_ids.tolist() == want
    assert out.logprobs is None


# ---- log-probabilities ---------------------------------------------------------------------------


def check_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, got, num: int, what: str, exact_ids: bool = True
) -> None:
    """Against log_softmax of ``raw`` in float64. ``exact_ids``: the top ids are the reference's (no
    equal logits among them); otherwise any ids whose log-probabilities are the largest."""
    sampled, top_values, top_ids, _ = got
    want = torch.log_softmax(raw.double(), dim=-1)
    assert top_values.shape == top_ids.shape == (raw.size(0), num), (what, top_values.shape)
    assert (sampled.double() - want.gather(1, tokens.unsqueeze(1)).squeeze(1)).abs().max() < 1e-5, (
        what
    )
    assert (top_values.double() - want.gather(1, top_ids)).abs().max() < 1e-5, what
    want_values, want_ids = want.topk(num, dim=-1)
    assert (top_values.double() - want_values).abs().max() < 1e-5, f"{what}: not the {num} largest"
    if exact_ids:
        assert torch.equal(top_ids, want_ids), (
            f"{what}: top ids {top_ids.tolist()}, want {want_ids.tolist()}"
        )
    assert all(len(set(ids)) == num for ids in top_ids.tolist()), (
        f"{what}: repeated ids {top_ids.tolist()}"
    )
    assert (top_values[:, 1:] <= top_values[:, :-1]).all(), f"{what}: not ordered"


def test_top_logprobs(model_logits):
    big = 40.0 * torch.randn(2, 512, generator=torch.Generator().manual_seed(15))  # far from 0
    raw = torch.cat([model_logits, big])
    tokens = torch.tensor([0, 511, 100, int(model_logits[3].argmax()), 7, 300])
    check_logprobs(raw, tokens, torch_ops.top_logprobs(raw, tokens, 5), 5, "float32")
    raw16 = raw.bfloat16()  # equal values are likely: the top ids are checked by their values
    check_logprobs(
        raw16, tokens, torch_ops.top_logprobs(raw16, tokens, 3), 3, "bfloat16", exact_ids=False
    )


def test_sampler_logprobs_from_raw_logits(model_logits):
    """Rows with penalties and min_tokens suppression still report log_softmax of the raw logits,
    for their sampled token; rows that asked for none are left out."""
    logits = model_logits.clone()
    suppressed = int(model_logits[0].argmax())
    seqs = [
        seq_with(
            SamplingParams(temperature=0.0, logprobs=3, min_tokens=1, stop_token_ids=[suppressed])
        ),
        seq_with(SamplingParams(temperature=0.7, seed=1)),
        seq_with(
            SamplingParams(temperature=1.0, top_k=4, repetition_penalty=1.5, logprobs=2, seed=2), 2
        ),
        seq_with(SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=0), 1),
    ]
    out = sample_seqs(seqs, logits)
    assert torch.equal(logits, model_logits), "the sampler changed its input logits"
    assert out.token_ids[0] != suppressed
    rows = torch.tensor([0, 2, 3])
    check_logprobs(model_logits[rows], out.token_ids[rows], out.logprobs, 3, "sampler logprobs")
