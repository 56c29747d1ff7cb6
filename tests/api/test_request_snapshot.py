"""The front end's edges: empty calls, a request that owns a snapshot of its sampling params, the
bound on ``n``, and an engine after ``exit()``."""

import pytest
from api_helpers import assert_idle, assert_serves_correctly, greedy, make_llm, run_to_completion
from hf_reference import assert_greedy_match, random_prompts

from nanovllm import SamplingParams


def test_empty_calls_return_empty_lists(llm):
    assert llm.generate([], use_tqdm=False) == []
    assert llm.chat([], use_tqdm=False) == []
    assert list(llm.stream([])) == []
    assert_idle(llm)


def test_params_changed_mid_stream_do_not_reach_the_request(llm, ckpt_tied, hf_ref):
    prompt = random_prompts(41, [10])[0]
    sp = greedy(12, stop=["never-in-the-text"])
    tokens = []
    for i, inc in enumerate(llm.stream([prompt], sp)):
        tokens += inc["token_ids"]
        assert inc["logprobs"] is None
        if i == 1:  # every field, also the lists in place
            sp.logprobs, sp.max_tokens, sp.temperature = 2, 3, 1.0
            sp.stop_token_ids = [tokens[-1]]
            sp.stop.append("")  # in place: no check runs
    assert_greedy_match(tokens, hf_ref.greedy(ckpt_tied.path, prompt, 12), "stream")
    assert_idle(llm)


def test_params_changed_after_queueing_do_not_reach_the_request(llm, ckpt_tied, hf_ref):
    prompt = random_prompts(42, [9])[0]
    sp = greedy(10, stop_token_ids=[])
    request_id = llm.add_request(prompt, sp)
    sp.stop_token_ids.append(hf_ref.greedy(ckpt_tied.path, prompt, 10).tokens[0])
    sp.max_tokens = 2
    finished = run_to_completion(llm)
    assert_greedy_match(finished[request_id], hf_ref.greedy(ckpt_tied.path, prompt, 10), "queued")


def test_in_place_edit_is_checked_when_queued(llm, ckpt_tied, hf_ref):
    sp = greedy(4, stop=["x"])
    sp.stop.append("")  # bypasses the assignment check
    prompts = random_prompts(43, [5, 6])
    with pytest.raises(ValueError, match="SamplingParams.stop must not contain an empty string"):
        llm.generate(prompts, [greedy(4), sp], use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        llm.add_request(prompts[0], sp)
    assert_idle(llm)
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)


def test_n_is_bounded_by_max_num_seqs(llm):
    bound = llm.config.max_num_seqs
    for call in (
        lambda sp: llm.add_request([1, 2, 3], sp),
        lambda sp: llm.generate([[1, 2, 3]], sp, use_tqdm=False),
    ):
        with pytest.raises(ValueError) as e:
            call(SamplingParams(n=3_000_000, max_tokens=1))
        message = str(e.value)
        assert "SamplingParams.n" in message and "3000000" in message, message
        assert f"max_num_seqs={bound}" in message, message
    assert_idle(llm)
    outputs = llm.generate([[1, 2, 3]], SamplingParams(n=bound, max_tokens=1), use_tqdm=False)
    assert len(outputs[0]["outputs"]) == bound


def test_exit_with_requests_queued(ckpt_tied):
    llm = make_llm(ckpt_tied.path)
    llm.add_request(random_prompts(44, [8])[0], greedy(20))
    llm.step()
    assert not llm.is_finished()
    before = llm.get_stats()
    llm.exit()
    assert llm.is_finished()
    stats = llm.get_stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["kv_cache_usage"] == 0.0
    assert stats["prompt_tokens"] == before["prompt_tokens"]  # cumulative counts stay
    with pytest.raises(RuntimeError, match="this LLM has exited"):
        llm.step()
