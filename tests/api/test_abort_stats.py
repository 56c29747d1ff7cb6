"""``abort_request``, interrupted calls (an exception or Ctrl-C inside ``generate`` ends only
its own requests), and ``get_stats``.

The references never come from the code under test: greedy loops over Hugging Face transformers
written in ``api_helpers.py`` (penalties, masked ids and stop conditions applied to its logits),
transformers log-softmax for logprobs, the Hugging Face tokenizer for texts and chat templates, and
exact block ids on fresh engines.
"""

import os
import signal

import pytest
from api_helpers import assert_idle, assert_serves_correctly, greedy, make_llm, run_to_completion
from hf_reference import assert_greedy_match, random_prompts

from nanovllm import SamplingParams

# ---- abort and interrupted calls ---------------------------------------------------------------


def test_abort_request(llm, ckpt_tied, hf_ref):
    sched, bm = llm.core.scheduler, llm.core.scheduler.block_manager
    running_prompt, waiting_prompt, pair_prompt = random_prompts(90, [40, 20, 35])
    running_id = llm.add_request(running_prompt, greedy(10))
    llm.step()
    waiting_id = llm.add_request(waiting_prompt, greedy(10))
    pair_id = llm.add_request(pair_prompt, SamplingParams(n=2, temperature=0.5, max_tokens=10))
    assert [s.seq_id for s in sched.running] == [running_id]
    assert [s.seq_id for s in sched.waiting] == [waiting_id, pair_id, pair_id + 1]
    held = list(sched.running[0].block_table)
    assert len(held) == 3 and all(bm.blocks[b].ref_count == 1 for b in held)

    assert llm.abort_request(running_id) is True
    assert all(b in bm.free_block_ids and bm.blocks[b].ref_count == 0 for b in held)
    assert llm.abort_request(waiting_id) is True
    llm.step()  # the pair's first completion is admitted, the second waits for its prompt
    assert [s.seq_id for s in sched.running] == [pair_id] and [s.seq_id for s in sched.waiting] == [
        pair_id + 1
    ]
    assert llm.abort_request(pair_id + 1) is False, "a completion's id is not a request id"
    assert llm.abort_request(pair_id) is True
    assert_idle(llm)
    assert llm.step() == ([], 0), "aborted requests are not reported"
    for request_id in (running_id, waiting_id, pair_id, 10**9):
        assert llm.abort_request(request_id) is False
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)


def failing_run(llm, monkeypatch, fail_at: int, exc=KeyboardInterrupt):
    """Make the model runner's ``fail_at``-th step raise ``exc`` (as a Ctrl-C or an error inside a
    step)."""
    real_run = llm.core.executor.runner.run
    calls = []

    def run(step):
        calls.append(step.is_prefill)
        if len(calls) == fail_at:
            raise exc("interrupted inside a step")
        return real_run(step)

    monkeypatch.setattr(llm.core.executor.runner, "run", run)
    return calls


def test_interrupted_generate_aborts_only_its_requests(llm, ckpt_tied, hf_ref, monkeypatch):
    queued = random_prompts(91, [18])[0]
    queued_id = llm.add_request(queued, greedy(12))
    calls = failing_run(llm, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts(92, [10, 33]), greedy(10), use_tqdm=False)
    assert calls == [True, False, False]
    monkeypatch.undo()
    # the queued request is not aborted (the failed step put it back at the head of waiting, to be
    # recomputed); the generate's requests are
    assert [s.seq_id for s in llm.core.scheduler.waiting] == [
        queued_id
    ] and not llm.core.scheduler.running
    assert llm.get_stats()["num_requests_waiting"] == 1
    finished = run_to_completion(llm)
    assert list(finished) == [queued_id]
    assert_greedy_match(
        finished[queued_id], hf_ref.greedy(ckpt_tied.path, queued, 12), "queued request"
    )
    assert_idle(llm)

    # without anything queued, the engine is idle right after the interruption
    failing_run(llm, monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(
            random_prompts(93, [25, 7, 50]),
            SamplingParams(temperature=0.7, max_tokens=10),
            use_tqdm=False,
        )
    monkeypatch.undo()
    assert_idle(llm)
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)


def test_error_in_prefill_step_spares_queued_request(llm, ckpt_tied, hf_ref, monkeypatch):
    """An exception inside the step that prefills a queued add_request (and the generate's own
    prompts): the generate's requests are aborted, the queued one still gets correct tokens."""
    queued = random_prompts(94, [26])[0]
    queued_id = llm.add_request(queued, greedy(8))
    failing_run(llm, monkeypatch, 1, RuntimeError)
    with pytest.raises(RuntimeError, match="interrupted"):
        llm.generate(random_prompts(95, [12]), greedy(8), use_tqdm=False)
    monkeypatch.undo()
    finished = run_to_completion(llm)
    assert list(finished) == [queued_id]
    assert_greedy_match(
        finished[queued_id], hf_ref.greedy(ckpt_tied.path, queued, 8), "queued request"
    )
    assert_idle(llm)


@pytest.mark.skipif(
    signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
    reason="needs Python's SIGINT handler",
)
@pytest.mark.parametrize(
    "queued_max_tokens", [8, 1], ids=["queued-runs-on", "queued-finishes-in-that-step"]
)
def test_ctrl_c_during_generate(llm, ckpt_tied, hf_ref, monkeypatch, queued_max_tokens):
    """A real Ctrl-C in the middle of a step takes effect when the step is complete: the queued
    add_request's request (prefilled in that step) keeps its result, the generate's are aborted."""
    queued = random_prompts(96, [22])[0]
    queued_id = llm.add_request(queued, greedy(queued_max_tokens))
    real_run = llm.core.executor.runner.run

    def run(step):
        os.kill(os.getpid(), signal.SIGINT)  # delivered while the step computes
        return real_run(step)

    monkeypatch.setattr(llm.core.executor.runner, "run", run)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts(97, [15, 40]), greedy(10), use_tqdm=False)
    monkeypatch.undo()
    left = [*llm.core.scheduler.waiting, *llm.core.scheduler.running]
    if queued_max_tokens > 1:  # its prefill step was completed, the generate's requests aborted
        assert [(s.seq_id, s.num_cached_tokens, len(s)) for s in left] == [(queued_id, 22, 23)]
    else:
        assert left == []
    finished = run_to_completion(llm)
    assert list(finished) == [queued_id], f"the queued request's result is lost: {finished}"
    ref = hf_ref.greedy(ckpt_tied.path, queued, queued_max_tokens)
    assert_greedy_match(finished[queued_id], ref, "queued request")
    assert_idle(llm)


# ---- get_stats -------------------------------------------------------------------------------


def test_get_stats(ckpt_tied, hf_ref):
    # step by step, the serial path (tokens counted in the step that computes them)
    with make_llm(ckpt_tied.path, num_kvcache_blocks=8, async_scheduling=False) as llm:
        stats = llm.get_stats()
        assert stats.pop("prefix_caching") is True  # a dense model caches prefixes
        assert all(value == 0 for value in stats.values()), stats
        short, shared = random_prompts(100, [10, 40])
        llm.add_request(short, greedy(8))
        llm.add_request(shared, SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=8))

        def counts():
            s = llm.get_stats()
            return (
                s["num_requests_running"],
                s["num_requests_waiting"],
                s["kv_cache_usage"],
                s["prompt_tokens"],
                s["generation_tokens"],
                s["prefix_cache_hit_rate"],
            )

        llm.step()  # prefill: short (1 block) and the first completion (3 blocks); the second waits
        assert counts() == (2, 1, 4 / 8, 50, 2, 0.0)
        llm.step()  # prefill of the second completion: its last 8 tokens, 32 from the cache
        assert counts() == (3, 0, 5 / 8, 58, 3, 32 / 90)
        llm.step()  # decode
        assert counts() == (3, 0, 5 / 8, 58, 6, 32 / 90)
        run_to_completion(llm)
        assert counts() == (0, 0, 0.0, 58, 24, 32 / 90)

        out = llm.generate([shared], greedy(4), use_tqdm=False)[0]
        assert out["num_cached_tokens"] == 32
        assert_greedy_match(
            out["token_ids"], hf_ref.greedy(ckpt_tied.path, shared, 4), "repeated prompt"
        )
        assert counts() == (0, 0, 0.0, 66, 28, 64 / 130)
        stats = llm.get_stats()
        assert (
            stats["num_preemptions"] == 0
            and stats["prefill_throughput"] > 0
            and stats["decode_throughput"] > 0
        )

        # four requests of 60 tokens (4 blocks each) in 8 blocks: preemption
        prompts = random_prompts(101, [30, 30, 30, 30])
        outputs = llm.generate(prompts, greedy(30), use_tqdm=False)
        for i, (o, p) in enumerate(zip(outputs, prompts)):
            assert_greedy_match(
                o["token_ids"], hf_ref.greedy(ckpt_tied.path, p, 30), f"prompts[{i}]"
            )
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0
        assert stats["generation_tokens"] == 28 + 120
        assert stats["prompt_tokens"] >= 66 + 120
        assert_idle(llm)
