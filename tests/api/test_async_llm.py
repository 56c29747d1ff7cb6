"""``AsyncLLM``: concurrent streams give ``LLM.generate``'s tokens and texts in each output kind;
abort, a cancelled or abandoned consumer, pause (abort, wait, keep) and resume around a weight
update, errors that reach the awaiting coroutine, shutdown, and an idle thread that does not spin.

References: ``LLM.generate`` greedy on engines of the same checkpoints (itself checked against
transformers in test_generate.py), the Hugging Face tokenizer for texts."""

import asyncio
import dataclasses
import gc
import os
import time

import pytest
from api_helpers import STOP_MAX_TOKENS, STOP_PROMPT, greedy, make_llm
from hf_reference import build_checkpoint, random_prompts
from safetensors.torch import load_file
from test_stream import check_increments

from nanovllm import RequestOutputKind, SamplingParams
from nanovllm.v1.engine.async_llm import AsyncLLM, RetryableRequestError

DELTA, FINAL = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
ENGINE = dict(num_kvcache_blocks=64, max_num_seqs=16)


@pytest.fixture(scope="module")
def aengine(ckpt_tied):
    engine = AsyncLLM(ckpt_tied.path, **make_kwargs())
    yield engine
    engine.shutdown()


def make_kwargs(**kwargs) -> dict:
    return dict(kvcache_block_size=16, max_model_len=256, device="cpu", **ENGINE) | kwargs


async def collect(engine, prompt, params, request_id) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def drain(stream) -> list:
    return [out async for out in stream]


async def wait_idle(engine, timeout=5.0) -> dict:
    """The engine's counters once nothing runs and no block is held (or the last ones seen)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_stats()
        idle = (stats["num_requests_running"], stats["num_requests_waiting"])
        if (idle == (0, 0) and stats["kv_cache_usage"] == 0.0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.01)


def assert_idle_stats(stats: dict) -> None:
    idle = (stats["num_requests_running"], stats["num_requests_waiting"], stats["kv_cache_usage"])
    assert idle == (0, 0, 0.0), stats


# ---- streams ---------------------------------------------------------------------------------


def test_concurrent_streams_match_generate(aengine, llm):
    prompts = random_prompts(31, [3, 9, 17, 30] * 4)
    params = [greedy(8 + i) for i in range(16)]
    expected = llm.generate(prompts, params, use_tqdm=False)

    async def main():
        jobs = [
            collect(aengine, p, sp, f"req-{i}") for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        return await asyncio.gather(*jobs)

    for i, (outs, ref) in enumerate(zip(asyncio.run(main()), expected)):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], i
        assert all(o.request_id == f"req-{i}" and o.prompt_token_ids == prompts[i] for o in outs)
        final = outs[-1].outputs[0]
        assert final.token_ids == ref.outputs[0].token_ids and final.text == ref.outputs[0].text
        assert final.finish_reason == "length" and len(outs) > 1, i
        for before, after in zip(outs, outs[1:]):  # CUMULATIVE: each output extends the last
            ids = after.outputs[0].token_ids
            assert ids[: len(before.outputs[0].token_ids)] == before.outputs[0].token_ids
    assert_idle_stats(asyncio.run(aengine.get_stats()))


def test_delta_pieces_add_up_and_final_only_yields_once(aengine, llm, tokenizer, stop_case):
    prompts = random_prompts(71, [9, 30]) + [STOP_PROMPT]
    params = [
        SamplingParams(temperature=1.0, seed=21, stop=["es", "\n"], logprobs=2, max_tokens=24),
        SamplingParams(temperature=0.9, seed=22, max_tokens=16),
        greedy(STOP_MAX_TOKENS, stop=[stop_case.stop]),  # spans two tokens
    ]
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert expected[2].outputs[0].text == stop_case.text[: stop_case.at]

    async def main():
        delta = [dataclasses.replace(p, output_kind=DELTA) for p in params]
        final = [dataclasses.replace(p, output_kind=FINAL) for p in params]
        jobs = [collect(aengine, p, sp, f"d{i}") for i, (p, sp) in enumerate(zip(prompts, delta))]
        jobs += [collect(aengine, p, sp, f"f{i}") for i, (p, sp) in enumerate(zip(prompts, final))]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    for i, (outs, ref) in enumerate(zip(results[:3], expected)):
        pieces = [{**o.outputs[0].__dict__, "finished": o.finished} for o in outs]
        out = {**ref.outputs[0].__dict__, "logprobs": None}  # logprobs: compared below
        logprobs = [e for p in pieces for e in p["logprobs"] or ()]
        pieces = [p | {"logprobs": None} for p in pieces]
        check_increments(pieces, out, tokenizer.decode(out["token_ids"]), i)
        for got, want in zip(logprobs, ref.outputs[0].logprobs or (), strict=True):
            assert got.keys() == want.keys(), i  # batches differ: values to float tolerance
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got), i
    for outs, ref in zip(results[3:], expected):
        assert len(outs) == 1 and outs[0].finished
        assert outs[0].prompt == ref.prompt and len(outs[0].outputs) == 1
        got, want = outs[0].outputs[0], ref.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text, want.token_ids, want.finish_reason, want.stop_reason,
        )  # fmt: skip
        assert (got.logprobs is None) == (want.logprobs is None)
        if got.logprobs is not None:  # batches differ: values to float tolerance
            assert abs(got.cumulative_logprob - want.cumulative_logprob) < 1e-3


def test_duplicate_live_request_id(aengine):
    async def main():
        first = aengine.generate([1, 2, 3], greedy(200), "same")
        await first.__anext__()
        with pytest.raises(ValueError, match="request_id 'same' is already in use"):
            await aengine.generate([4, 5], greedy(4), "same").__anext__()
        await first.aclose()  # frees the id
        outs = await collect(aengine, [4, 5], greedy(4), "same")
        return outs[-1], await wait_idle(aengine)

    final, stats = asyncio.run(main())
    assert final.finished and len(final.outputs[0].token_ids) == 4
    assert_idle_stats(stats)


# ---- ending a request early --------------------------------------------------------------------


def test_abort_mid_stream(aengine):
    async def main():
        outs = []
        async for out in aengine.generate([7, 8, 9], greedy(200), "to-abort"):
            outs.append(out)
            if len(outs) == 3:
                await aengine.abort("to-abort")
        return outs, await wait_idle(aengine)

    outs, stats = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert 3 <= len(outs[-1].outputs[0].token_ids) < 200
    assert_idle_stats(stats)


def test_cancelled_or_abandoned_consumer_frees_its_request(aengine):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in aengine.generate([3, 1, 4, 1, 5], greedy(200), "cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after_cancel = await wait_idle(aengine)
        async for _ in aengine.generate([2, 7, 1, 8], greedy(200), "abandoned"):
            break  # the generator is dropped here: its finalizer aborts the request
        gc.collect()
        return after_cancel, await wait_idle(aengine), aengine.get_num_unfinished_requests()

    after_cancel, after_break, unfinished = asyncio.run(main())
    assert_idle_stats(after_cancel)
    assert_idle_stats(after_break)
    assert unfinished == 0


# ---- errors ------------------------------------------------------------------------------------


def test_bad_requests_raise_in_the_awaiting_coroutine_and_the_engine_serves_on(aengine, llm):
    async def main():
        with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
            await collect(aengine, [1, 2], {"max_tokens": 3}, "bad-type")
        with pytest.raises(ValueError, match=r"request 'too-long': the prompt has 300 tokens"):
            await collect(aengine, [1] * 300, greedy(4), "too-long")
        with pytest.raises(ValueError, match="mode='later'; allowed: abort, wait, keep"):
            await aengine.pause_generation(mode="later")
        with pytest.raises(ValueError, match="priority=3 is not supported"):
            await aengine.generate([1, 2], greedy(4), "prio", priority=3).__anext__()
        with pytest.raises(RuntimeError, match="needs sleep mode"):  # refused before any pause
            await aengine.sleep(1)
        assert not await aengine.is_paused()
        return await collect(aengine, [5, 6, 7], greedy(6), "good")

    outs = asyncio.run(main())
    ref = llm.generate([[5, 6, 7]], greedy(6), use_tqdm=False)[0]
    assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert aengine.get_num_unfinished_requests() == 0


def test_a_step_error_reaches_the_streams_and_the_engine_serves_on(aengine, llm):
    core = aengine.llm.core
    real_step = core.step

    def failing_step():
        core.step = real_step
        raise RuntimeError("step failed on purpose")

    async def main():
        first = aengine.generate([9, 9, 9], greedy(50), "fails")
        await first.__anext__()
        core.step = failing_step
        with pytest.raises(RuntimeError, match="step failed on purpose"):
            async for _ in first:
                pass
        return await wait_idle(aengine), await collect(aengine, [5, 6, 7], greedy(6), "after")

    stats, outs = asyncio.run(main())
    assert_idle_stats(stats)
    ref = llm.generate([[5, 6, 7]], greedy(6), use_tqdm=False)[0]
    assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids


def device_name(runner) -> str:
    return str(runner.device)


def test_collective_rpc_and_idle_thread(aengine):
    assert asyncio.run(aengine.collective_rpc(device_name)) == ["cpu"]
    tid = aengine._engine.thread.native_id
    with open(f"/proc/self/task/{tid}/stat") as f:
        before = sum(map(int, f.read().rsplit(")", 1)[1].split()[11:13]))
    time.sleep(0.5)
    with open(f"/proc/self/task/{tid}/stat") as f:
        after = sum(map(int, f.read().rsplit(")", 1)[1].split()[11:13]))
    assert after - before <= 2, "the idle engine thread uses the CPU"  # clock ticks of 10 ms


# ---- pause and resume ----------------------------------------------------------------------------


def test_pause_abort_and_wait(aengine, llm):
    async def main():
        streams = [aengine.generate([4, 4, i], greedy(200), f"p{i}") for i in range(3)]
        for s in streams:
            await s.__anext__()
        await aengine.pause_generation(mode="abort")
        finals = [(await drain(s))[-1] for s in streams]
        paused = await aengine.is_paused()
        with pytest.raises(RetryableRequestError, match="generation is paused"):
            await collect(aengine, [1, 2], greedy(3), "refused")
        stats = await wait_idle(aengine)
        await aengine.resume_generation()
        # "wait": the running request ends normally before the pause returns
        waited = aengine.generate([5, 6, 7], greedy(6), "waited")
        first = await waited.__anext__()
        await aengine.pause_generation(mode="wait")
        rest = [o async for o in waited]
        await aengine.resume_generation()
        return finals, paused, stats, [first, *rest], await aengine.is_paused()

    finals, paused, stats, waited, paused_after = asyncio.run(main())
    assert all(f.finished and f.outputs[0].finish_reason == "abort" for f in finals)
    assert paused and not paused_after
    assert_idle_stats(stats)
    ref = llm.generate([[5, 6, 7]], greedy(6), use_tqdm=False)[0]
    assert waited[-1].outputs[0].token_ids == ref.outputs[0].token_ids


def test_pause_keep_update_weights_resume(ckpt_tied, tmp_path):
    """Kept requests go on with the new weights: what follows the pause is what a fresh engine of
    the second checkpoint continues from the tokens so far; a request sent while paused waits."""
    second = build_checkpoint(
        str(tmp_path / "second"), seed=5, rope_theta=12345.0, rope_style="top-level",
        tie_word_embeddings=True,
    )  # fmt: skip
    weights = load_file(os.path.join(second.path, "model.safetensors"))
    prompt, later_prompt, max_tokens = [11, 12, 13, 14], [21, 22, 23], 40
    engine = AsyncLLM(ckpt_tied.path, **make_kwargs())

    async def main():
        stream = engine.generate(prompt, greedy(max_tokens, output_kind=DELTA), "kept")
        head = []
        while len(head) < 3:
            head += (await stream.__anext__()).outputs[0].token_ids
        await engine.pause_generation(mode="keep")
        later = asyncio.create_task(collect(engine, later_prompt, greedy(5), "later"))
        nxt = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0.2)
        if nxt.done():  # sent before the pause, taken only now
            head += nxt.result().outputs[0].token_ids
            nxt = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0.3)
        assert not nxt.done() and not later.done(), "tokens came while paused"
        await engine.update_weights(weights.items())
        await engine.resume_generation()
        rest = [(await nxt).outputs[0].token_ids]
        rest += [o.outputs[0].token_ids async for o in stream]
        return head, [t for r in rest for t in r], (await later)[-1]

    try:
        head, tail, later = asyncio.run(main())
    finally:
        engine.shutdown()
    with make_llm(ckpt_tied.path, num_kvcache_blocks=32) as first_llm:
        ref_head = first_llm.generate([prompt], greedy(len(head)), use_tqdm=False)[0]
    with make_llm(second.path, num_kvcache_blocks=32) as second_llm:
        ref = second_llm.generate(
            [prompt + head, later_prompt], [greedy(max_tokens - len(head)), greedy(5)],
            use_tqdm=False,
        )  # fmt: skip
    assert head == ref_head.outputs[0].token_ids
    assert tail == ref[0].outputs[0].token_ids
    assert later.outputs[0].token_ids == ref[1].outputs[0].token_ids


# ---- shutdown ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Args:  # fields: ``model`` and LLM()'s keywords, as EngineArgs has them
    model: str
    device: str = "cpu"
    num_kvcache_blocks: int = 16
    kvcache_block_size: int = 16
    max_model_len: int = 256


def test_from_engine_args_then_shutdown_then_calls_raise(ckpt_tied):
    engine = AsyncLLM.from_engine_args(Args(ckpt_tied.path))
    assert engine.llm.config.num_kvcache_blocks == 16 and engine.get_tokenizer() is not None
    thread = engine._engine.thread
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert not thread.is_alive() and engine.is_stopped and not engine.errored

    async def main():
        with pytest.raises(RuntimeError, match="has been shut down"):
            await collect(engine, [1, 2], greedy(3), "late")
        with pytest.raises(RuntimeError, match="has been shut down"):
            await engine.pause_generation(mode="keep")

    asyncio.run(main())


# ---- data parallel -------------------------------------------------------------------------------


def test_two_replicas_serve_streams(ckpt_tied, llm):
    prompts = random_prompts(41, [5, 12, 20, 33])
    expected = llm.generate(prompts, greedy(10), use_tqdm=False)
    engine = AsyncLLM(ckpt_tied.path, **make_kwargs(data_parallel_size=2))

    async def main():
        params = greedy(10, output_kind=DELTA)
        jobs = [collect(engine, p, params, f"dp{i}") for i, p in enumerate(prompts)]
        results = await asyncio.gather(*jobs)
        return results, await wait_idle(engine)

    try:
        results, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    for outs, ref in zip(results, expected):
        assert [t for o in outs for t in o.outputs[0].token_ids] == ref.outputs[0].token_ids
    assert_idle_stats(stats)
    assert [r["num_requests_running"] for r in stats["replicas"]] == [0, 0]
