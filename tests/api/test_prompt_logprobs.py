"""``SamplingParams(prompt_logprobs=k)`` against transformers: log_softmax of its float32 logits at
every prompt position, on the tiny tied checkpoint. Each entry must hold exactly the prompt token
and the reference's top ``k`` ids, every value within 1e-4, whether the prompt is computed in one
piece, in chunks, beside a cached prefix, after a preemption, or across tensor-parallel ranks.
"""

import pytest
import torch
from api_helpers import greedy, make_llm
from hf_reference import random_prompts

from nanovllm import SamplingParams
from nanovllm.engine.sequence import request_sequences
from nanovllm.engine.step import SamplingRows, Step
from nanovllm.features.attach import attach_processors

TOL = 1e-4


def reference(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i scores prompt token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).double()


def check_prompt_logprobs(entries, prompt: list[int], ref: torch.Tensor, k: int, what: str) -> None:
    assert entries is not None and len(entries) == len(prompt), (
        f"{what}: {entries and len(entries)} entries"
    )
    assert entries[0] is None, what
    for i, entry in enumerate(entries[1:]):
        token = prompt[i + 1]
        top = ref[i].topk(k).indices.tolist() if k else []
        assert set(entry) == {token, *top}, (
            f"{what}: token {i + 1}: ids {sorted(entry)}, want {sorted({token, *top})}"
        )
        for t, value in entry.items():
            assert abs(value - float(ref[i, t])) < TOL, (
                f"{what}: token {i + 1}, id {t}: {value} vs {float(ref[i, t])}"
            )


@pytest.fixture(scope="module")
def model(hf_ref, ckpt_tied):
    return hf_ref.model(ckpt_tied.path)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_prompt_logprobs_in_a_mixed_batch(ckpt_tied, hf_ref, model, async_scheduling):
    """Asking and plain requests in one batch, ``logprobs`` beside them, chunked prefill (32 tokens
    a step over prompts of up to 70): the entries match, the plain rows have none, and every
    request's tokens are transformers' greedy ones."""
    llm = make_llm(ckpt_tied.path, async_scheduling=async_scheduling, max_num_batched_tokens=32)
    try:
        prompts = random_prompts(300, [1, 9, 70, 33, 45])
        ks = [2, 0, 5, None, 20]
        params = [
            greedy(4, prompt_logprobs=k, logprobs=1 if i == 2 else None) for i, k in enumerate(ks)
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, k, out in zip(prompts, ks, outputs):
            want = hf_ref.greedy(ckpt_tied.path, prompt, 4).tokens
            assert out["token_ids"] == want
            if k is None:
                assert out["prompt_logprobs"] is None
            else:
                check_prompt_logprobs(
                    out["prompt_logprobs"], prompt, reference(model, prompt), k, f"k={k}"
                )
        assert outputs[2]["logprobs"] is not None and len(outputs[2]["logprobs"]) == 4
    finally:
        llm.exit()


def test_prompt_logprobs_beside_a_cached_prefix(llm, model):
    """A prompt whose first three blocks are in the prefix cache: the asking request computes all
    of it (no hits) and its entries match; the same prompt without asking hits those blocks."""
    base = random_prompts(301, [60])[0]
    llm.generate([base], greedy(1), use_tqdm=False)
    stats = llm.get_stats()
    asking, plain = llm.generate(
        [base[:55], base[:55]], [greedy(2, prompt_logprobs=3), greedy(2)], use_tqdm=False
    )
    check_prompt_logprobs(
        asking["prompt_logprobs"], base[:55], reference(model, base[:55]), 3, "cached prefix"
    )
    assert asking["num_cached_tokens"] == 0
    assert plain["num_cached_tokens"] == 48 and plain["prompt_logprobs"] is None
    hits = llm.get_stats()["prefix_cache_hits"] - stats["prefix_cache_hits"]
    assert hits == 48, "only the plain request hits the cache"
    assert asking["token_ids"] == plain["token_ids"]


def test_prompt_logprobs_with_n_and_stream(llm, model):
    """n = 3 completions report the prompt once (the request's); a stream delivers them in
    completion 0's first increment and None in every other one."""
    prompt = random_prompts(302, [40])[0]
    ref = reference(model, prompt)
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=3, prompt_logprobs=4)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    check_prompt_logprobs(out["prompt_logprobs"], prompt, ref, 4, "n=3")
    increments = list(llm.stream([prompt], params))
    firsts = [inc for inc in increments if inc["prompt_logprobs"] is not None]
    assert (
        len(firsts) == 1
        and firsts[0]["completion"] == 0
        and firsts[0] is next(inc for inc in increments if inc["completion"] == 0)
    )
    check_prompt_logprobs(firsts[0]["prompt_logprobs"], prompt, ref, 4, "stream")
    for c in range(3):
        tokens = [t for inc in increments if inc["completion"] == c for t in inc["token_ids"]]
        assert tokens == out["outputs"][c]["token_ids"]


def test_prompt_logprobs_after_preemption(ckpt_tied, model):
    """A cache too small for both requests: one is preempted while decoding and computes its
    prompt again (then without scoring it); its entries are each prompt token's once, and right."""
    llm = make_llm(ckpt_tied.path, num_kvcache_blocks=12, max_num_batched_tokens=64)
    try:
        prompts = random_prompts(303, [90, 85])
        outputs = llm.generate(
            prompts, greedy(60, prompt_logprobs=1, ignore_eos=True), use_tqdm=False
        )
        assert llm.get_stats()["num_preemptions"] > 0
        for prompt, out in zip(prompts, outputs):
            check_prompt_logprobs(
                out["prompt_logprobs"], prompt, reference(model, prompt), 1, "preempted"
            )
    finally:
        llm.exit()


@pytest.mark.parametrize(
    "value, error", [(-2, ValueError), (1.5, TypeError), ("3", TypeError), (True, TypeError)]
)
def test_bad_prompt_logprobs(llm, value, error):
    with pytest.raises(error, match=r"SamplingParams\.prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=value)
    params = SamplingParams(prompt_logprobs=2)
    with pytest.raises(error, match=r"SamplingParams\.prompt_logprobs must be"):
        params.prompt_logprobs = value
    assert params.prompt_logprobs == 2


def test_prompt_logprobs_tensor_parallel(ckpt_tied, model):
    """Two ranks (gloo): the LM head's vocabulary slices gathered for every scored position."""
    prompts = random_prompts(304, [50, 7])
    llm = make_llm(ckpt_tied.path, tensor_parallel_size=2, max_num_batched_tokens=32)
    try:
        outputs = llm.generate(prompts, greedy(2, prompt_logprobs=3), use_tqdm=False)
    finally:
        llm.exit()
    for prompt, out in zip(prompts, outputs):
        check_prompt_logprobs(out["prompt_logprobs"], prompt, reference(model, prompt), 3, "tp=2")


def test_which_prompt_tokens_a_step_scores():
    """The scoring of chunks, exactly: the logits at position p score prompt token p + 1, the last
    prompt position scores nothing (it samples), tokens scored before are not scored again (a
    sequence whose step failed computes its prompt again), and only completion 0 scores."""
    prompt = list(range(100, 110))  # 10 tokens
    first, second = request_sequences(0, prompt, SamplingParams(n=2, prompt_logprobs=1), 4)
    attach_processors([first, second], [])
    assert second.processors == [] and second.uses_prefix_cache
    (scorer,) = first.processors
    assert not first.uses_prefix_cache  # it computes its whole prompt

    def prompt_scoring(seqs, num_computed, num_new):
        rows = SamplingRows([0.0] * len(seqs), [0] * len(seqs))
        step = Step(True, [], num_computed, num_new, [[]] * len(seqs), None, rows)
        for i, seq in enumerate(seqs):
            for p in seq.processors:
                p.contribute(step, i, seq, sum(num_new[:i]))
        return step.prompt_scoring

    def take_prompt_logprobs(seq, first_position, entries):
        scorer.take(seq, {"prompt_logprobs": (first_position, entries)})

    # a step with another sequence's 3 tokens first, then the first chunk of 4 (positions 0..3)
    s = prompt_scoring([second, first], [0, 0], [3, 4])
    assert (s.rows, s.firsts, s.counts, s.nums) == ([1], [1], [4], [1])
    assert (s.indices, s.targets) == ([3, 4, 5, 6], prompt[1:5])
    take_prompt_logprobs(first, 1, [{t: -1.0} for t in prompt[1:5]])
    # the last chunk (positions 4..9): tokens 5..9, not past the prompt
    s = prompt_scoring([first], [4], [6])
    assert (s.firsts, s.counts, s.indices, s.targets) == ([5], [5], [0, 1, 2, 3, 4], prompt[5:10])
    # computed again from the start (positions 0..5): only tokens 5 and 6 are new
    s = prompt_scoring([first], [0], [6])
    assert (s.firsts, s.counts, s.indices, s.targets) == ([5], [2], [4, 5], prompt[5:7])
    take_prompt_logprobs(first, 5, [{prompt[5]: -2.0}])
    take_prompt_logprobs(first, 5, [{prompt[5]: -9.0}, {prompt[6]: -3.0}])  # token 5 again: once
    assert scorer.entries == [None] + [{t: -1.0} for t in prompt[1:5]] + [
        {prompt[5]: -2.0},
        {prompt[6]: -3.0},
    ]
    assert scorer.scores_prompt(first) and not first.uses_prefix_cache
