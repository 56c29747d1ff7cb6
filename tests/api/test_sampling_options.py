"""Penalties and logprobs against transformers, ``n`` completions sharing their prompt's
blocks, and seeded sampling independent of the batch.

The references never come from the code under test: greedy loops over Hugging Face transformers
written in ``api_helpers.py`` (penalties, masked ids and stop conditions applied to its logits),
transformers log-softmax for logprobs, the Hugging Face tokenizer for texts and chat templates, and
exact block ids on fresh engines.
"""

import pytest
import torch
from api_helpers import (
    assert_idle,
    count_penalties,
    greedy,
    hf_greedy_loop,
    hf_logprobs,
    make_llm,
    repetition_penalty,
    run_to_completion,
)
from hf_reference import TIE_GAP, VOCAB_SIZE, assert_greedy_match, random_prompts

from nanovllm import SamplingParams

# ---- penalties and logprobs against transformers ---------------------------------------------

PENALTY_CASES = [
    # (prompt seed, params, reference adjustment, the same with a wrong scope)
    (61, dict(repetition_penalty=1.5), repetition_penalty(1.5), repetition_penalty(1.5, "output")),
    (
        61,
        dict(presence_penalty=1.5),
        count_penalties(1.5, 0),
        count_penalties(1.5, 0, "prompt+output"),
    ),
    (
        61,
        dict(presence_penalty=-1.0),
        count_penalties(-1.0, 0),
        count_penalties(-1.0, 0, "prompt+output"),
    ),
    (
        70,
        dict(frequency_penalty=2.0),
        count_penalties(0, 2.0),
        count_penalties(0, 2.0, "prompt+output"),
    ),
    (
        69,
        dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
        lambda *a: (repetition_penalty(1.2)(*a), count_penalties(0.5, 0.5)(*a)),
        None,
    ),
]


def test_penalties_match_transformers(llm, ckpt_tied, hf_ref):
    model = hf_ref.model(ckpt_tied.path)
    max_tokens = 16
    prompts, params, refs = [], [], []
    for seed, kwargs, adjust, wrong in PENALTY_CASES:
        prompt = random_prompts(seed, [24])[0]
        plain = hf_ref.greedy(ckpt_tied.path, prompt, max_tokens)
        ref = hf_greedy_loop(model, prompt, max_tokens, adjust=adjust)
        assert ref.tokens != plain.tokens, f"{kwargs} must change the greedy tokens"
        if wrong is not None:
            other = hf_greedy_loop(model, prompt, max_tokens, adjust=wrong, until_not=ref.tokens)
            assert other.tokens != ref.tokens, f"{kwargs}: the wrong scope must give other tokens"
        prompts.append(prompt)
        params.append(greedy(max_tokens, **kwargs))
        refs.append(ref)
    plain_prompt = random_prompts(62, [24])[0]  # an unpenalised row in the same batch
    outputs = llm.generate(prompts + [plain_prompt], params + [greedy(max_tokens)], use_tqdm=False)
    for out, ref, (_, kwargs, _, _) in zip(outputs, refs, PENALTY_CASES):
        assert_greedy_match(out["token_ids"], ref, str(kwargs))
    assert_greedy_match(
        outputs[-1]["token_ids"],
        hf_ref.greedy(ckpt_tied.path, plain_prompt, max_tokens),
        "plain row",
    )


def check_logprob_entries(out, ref_logprobs: torch.Tensor, num: int, what: str) -> None:
    """Each entry holds the sampled token and the ``num`` most likely ones, with transformers'
    values; ``cumulative_logprob`` is the sum over the sampled tokens."""
    assert len(out["logprobs"]) == len(out["token_ids"]), what
    for i, (token, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
        top = ref_logprobs[i].topk(num).indices.tolist()
        assert set(entry) == {token, *top}, (
            f"{what}: token {i} entry {sorted(entry)}, expected {sorted({token, *top})}"
        )
        for t, value in entry.items():
            reference = float(ref_logprobs[i, t])
            assert abs(value - reference) < 1e-4, (
                f"{what}: token {i}, id {t}: {value} vs {reference}"
            )
    sampled = [entry[t] for t, entry in zip(out["token_ids"], out["logprobs"])]
    assert out["cumulative_logprob"] == pytest.approx(sum(sampled), abs=1e-9), what
    ref_sum = sum(float(ref_logprobs[i, t]) for i, t in enumerate(out["token_ids"]))
    assert abs(out["cumulative_logprob"] - ref_sum) < 1e-3, what


def test_logprobs_match_transformers(llm, ckpt_tied, hf_ref):
    model = hf_ref.model(ckpt_tied.path)
    prompt, other = random_prompts(80, [17, 29])
    params = [
        greedy(8, logprobs=3),
        SamplingParams(
            temperature=5.0, seed=3, max_tokens=12, logprobs=2
        ),  # samples far from the top
        SamplingParams(temperature=1.0, seed=4, max_tokens=6, logprobs=0),
        greedy(5),
    ]
    out, hot, only_sampled, none = llm.generate(
        [prompt, prompt, other, other], params, use_tqdm=False
    )
    ref = hf_ref.greedy(ckpt_tied.path, prompt, 8)
    assert min(ref.gaps) > 100 * TIE_GAP
    assert out["token_ids"] == ref.tokens
    check_logprob_entries(
        out, hf_logprobs(model, prompt, out["token_ids"]), 3, "greedy, logprobs=3"
    )
    assert all(len(entry) == 3 for entry in out["logprobs"])  # the sampled token is the top one
    check_logprob_entries(
        hot, hf_logprobs(model, prompt, hot["token_ids"]), 2, "temperature 5, logprobs=2"
    )
    assert any(len(entry) == 3 for entry in hot["logprobs"]), (
        "some sampled token should be outside the top 2"
    )
    check_logprob_entries(
        only_sampled, hf_logprobs(model, other, only_sampled["token_ids"]), 0, "logprobs=0"
    )
    assert (none["logprobs"], none["cumulative_logprob"]) == (None, None)
    for o in (out, hot, only_sampled):
        first = o["outputs"][0]
        assert (first["logprobs"], first["cumulative_logprob"]) == (
            o["logprobs"],
            o["cumulative_logprob"],
        )


# ---- n completions --------------------------------------------------------------------------


def test_n_completions_share_prompt_blocks(ckpt_tied):
    prompt = random_prompts(40, [40])[0]  # 2 full blocks + 8 tokens
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=6)
    with make_llm(ckpt_tied.path, num_kvcache_blocks=16) as llm:
        sched, bm = llm.core.scheduler, llm.core.scheduler.block_manager
        rid = llm.add_request(prompt, params)
        _, num_tokens = llm.step()
        # completion 0 computes the prompt; the others wait for its blocks to be in the cache
        assert num_tokens == 40
        assert [s.seq_id for s in sched.running] == [rid] and [s.seq_id for s in sched.waiting] == [
            rid + 1,
            rid + 2,
        ]
        assert sched.running[0].block_table == [0, 1, 2]
        _, num_tokens = llm.step()
        assert num_tokens == 16, "completions 1 and 2 compute only their last, partial block"
        tables = {s.seq_id: s.block_table for s in sched.running}
        assert tables == {rid: [0, 1, 2], rid + 1: [0, 1, 3], rid + 2: [0, 1, 4]}, tables
        assert [bm.blocks[b].ref_count for b in range(6)] == [3, 3, 1, 1, 1, 0]
        assert {s.seq_id: s.num_prefix_hit_tokens for s in sched.running} == {
            rid: 0,
            rid + 1: 32,
            rid + 2: 32,
        }
        finished = run_to_completion(llm)
        assert sorted(finished) == [rid, rid + 1, rid + 2] and all(
            len(t) == 6 for t in finished.values()
        )
        assert llm.get_stats()["prompt_tokens"] == 56
        assert len({tuple(t) for t in finished.values()}) == 3, (
            "three seeds should give three completions"
        )
        assert_idle(llm)

        # the same request through generate: the same completions, in order, the prompt from the
        # cache
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert [c["index"] for c in out["outputs"]] == [0, 1, 2]
        assert [c["token_ids"] for c in out["outputs"]] == [finished[rid + i] for i in range(3)]
        first = out["outputs"][0]
        for key in (
            "text",
            "token_ids",
            "finish_reason",
            "stop_reason",
            "logprobs",
            "cumulative_logprob",
        ):
            assert out[key] == first[key], key
        assert out["prompt_token_ids"] == prompt and out["num_cached_tokens"] == 32
        assert all(c["finish_reason"] == "length" for c in out["outputs"])

        # completion i is the request with seed + i
        singles = llm.generate(
            [prompt] * 3,
            [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=6) for i in range(3)],
            use_tqdm=False,
        )
        assert [s["token_ids"] for s in singles] == [c["token_ids"] for c in out["outputs"]]


# ---- seeded sampling -------------------------------------------------------------------------


def test_seeded_request_independent_of_batch(llm):
    prompt = random_prompts(50, [21])[0]
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=1234, max_tokens=16)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    others = random_prompts(51, [3, 40, 70])
    batch = [others[0], others[1], prompt, others[2], prompt]
    params = [
        greedy(5),
        SamplingParams(temperature=1.0, max_tokens=20),
        seeded,
        SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5, max_tokens=25, seed=9),
        SamplingParams(temperature=0.8, top_k=50, seed=1235, max_tokens=16),
    ]
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert outputs[2]["token_ids"] == alone, (
        "a seeded request must not depend on the batch around it"
    )
    assert outputs[4]["token_ids"] != alone, "another seed should draw other tokens"
    assert llm.generate([prompt], greedy(16), use_tqdm=False)[0]["token_ids"] != alone, (
        "the draw is not greedy"
    )


def test_an_overflowing_penalty_draws_inside_the_vocabulary(llm):
    """repetition_penalty=1e-40 turns the repeated tokens' positive logits into +inf: the draw then
    takes the lowest such id (docs/sampling.md), an id of the vocabulary, plain or filtered."""
    prompt = random_prompts(52, [12])[0]
    for extra in (dict(), dict(top_p=0.9), dict(min_p=0.1)):
        params = SamplingParams(temperature=0.8, repetition_penalty=1e-40, max_tokens=8, **extra)
        out = llm.generate([prompt, prompt], params, use_tqdm=False)
        for o in out:
            assert len(o["token_ids"]) == 8
            assert max(o["token_ids"]) < VOCAB_SIZE
