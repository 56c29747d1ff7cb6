"""Async scheduling (the host schedules and prepares step N+1 while the device computes step N, and
learns step N's tokens one step late) against the serial path, on the CPU: the same tokens, texts,
finish reasons and logprobs, through chunked prefill, preemption, prefix-cache hits, stop strings
and stop ids, min_tokens, seeds, n > 1, penalties, and two tensor-parallel ranks.
The serial path itself is checked against transformers by the other end-to-end tests."""

import pytest
from hf_reference import BLOCK_SIZE, random_prompts

from nanovllm import LLM, SamplingParams

BASE = random_prompts(201, [40])[
    0
]  # shared by several prompts: their first two blocks hit the cache


def make_llm(path: str, async_scheduling: bool, **kwargs) -> LLM:
    # 64-token prefill budget: prompts over 64 tokens are chunked; 20 blocks of 16: decode preempts
    kwargs = (
        dict(
            device="cpu",
            kvcache_block_size=BLOCK_SIZE,
            num_kvcache_blocks=20,
            max_model_len=256,
            max_num_batched_tokens=64,
            max_num_seqs=6,
        )
        | kwargs
    )
    return LLM(path, async_scheduling=async_scheduling, **kwargs)


def workload(tokenizer_text=None) -> tuple[list[list[int]], list[SamplingParams]]:
    """Twelve requests: greedy, seeded samples (top-k, top-p, n=2), penalties, logprobs, stop
    ids with min_tokens; ``tokenizer_text`` adds stop strings taken from a serial run's texts."""
    tails = random_prompts(202, [5, 30, 17, 60, 3, 9])
    prompts = [BASE + t for t in tails] + random_prompts(203, [90, 12, 70, 25, 48, 33])
    greedy = dict(temperature=0.0, max_tokens=28)
    params = [
        SamplingParams(**greedy),
        SamplingParams(**greedy, logprobs=3),
        SamplingParams(temperature=0.9, seed=7, max_tokens=30),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=26, n=2),
        SamplingParams(**greedy, repetition_penalty=1.3, presence_penalty=0.2),
        SamplingParams(temperature=1.0, max_tokens=20, seed=3, logprobs=2),
        SamplingParams(**greedy),
        SamplingParams(temperature=0.7, seed=5, max_tokens=33, min_p=0.05),
        SamplingParams(**greedy),
        SamplingParams(**greedy),
        SamplingParams(temperature=0.6, seed=9, max_tokens=24, frequency_penalty=0.5),
        SamplingParams(**greedy),
    ]
    return prompts, params


def comparable(outputs: list[dict]) -> list[list[tuple]]:
    return [
        [(c["token_ids"], c["text"], c["finish_reason"], c["stop_reason"]) for c in o["outputs"]]
        for o in outputs
    ]


def assert_logprobs_close(got: list[dict], want: list[dict], tol: float = 1e-5) -> None:
    """The same top tokens at every position, their logprobs within float32 rounding. Even on one
    rank they need not be equal: once a request ends, the async path still computes its row for one
    more step, so the other rows of that step go through a matrix multiply of another height, which
    on the CPU may sum in another order."""
    for i, (g, w) in enumerate(zip(got, want)):
        for j, (cg, cw) in enumerate(zip(g["outputs"], w["outputs"])):
            assert (cg["logprobs"] is None) == (cw["logprobs"] is None), (i, j)
            for pos, (a, b) in enumerate(zip(cg["logprobs"] or [], cw["logprobs"] or [])):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= tol for t in a), (
                    i,
                    j,
                    pos,
                    a,
                    b,
                )


def run(path: str, prompts, params, async_scheduling: bool, **kwargs) -> tuple[list[dict], dict]:
    with make_llm(path, async_scheduling, **kwargs) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(
            prompts[:3], params[:3], use_tqdm=False
        )  # served from the prefix cache
        assert llm.is_finished() and llm.get_stats()["kv_cache_usage"] == 0.0
        stats = llm.get_stats()
    return outputs + again, stats


@pytest.fixture(scope="module")
def stop_workload(ckpt_tied) -> tuple[list[list[int]], list[SamplingParams]]:
    """The workload with stop conditions cut from a serial run: a stop string spanning the middle
    of one greedy completion, a stop id with min_tokens past its first occurrence in another."""
    prompts, params = workload()
    with make_llm(ckpt_tied.path, False) as llm:
        serial = llm.generate(prompts, params, use_tqdm=False)
        tokenizer = llm.tokenizer
    tokens = serial[6]["token_ids"]
    stop = tokenizer.decode(tokens[10:12])
    params[6] = SamplingParams(temperature=0.0, max_tokens=28, stop=[stop])
    repeated = next(
        t for i, t in enumerate(serial[8]["token_ids"]) if t in serial[8]["token_ids"][:i]
    )
    params[8] = SamplingParams(
        temperature=0.0, max_tokens=28, stop_token_ids=[repeated], min_tokens=3
    )
    params[9] = SamplingParams(
        temperature=0.0, max_tokens=28, stop=[stop], include_stop_str_in_output=True
    )
    return prompts, params


@pytest.fixture(scope="module")
def serial_run(ckpt_tied, stop_workload) -> tuple[list[dict], dict]:
    return run(ckpt_tied.path, *stop_workload, False)


def test_async_matches_serial(ckpt_tied, stop_workload, serial_run):
    prompts, params = stop_workload
    serial, serial_stats = serial_run
    overlapped, async_stats = run(ckpt_tied.path, prompts, params, True)
    assert comparable(overlapped) == comparable(serial)
    assert_logprobs_close(overlapped, serial)
    assert [o["num_cached_tokens"] for o in overlapped[-3:]] == [
        o["num_cached_tokens"] for o in serial[-3:]
    ]
    # the workload reaches what it is meant to: preemption, prefix hits, chunked prompts, every
    # ending
    for stats in (serial_stats, async_stats):
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    assert max(len(p) for p in prompts) > 64
    reasons = {
        (c["finish_reason"], type(c["stop_reason"]).__name__) for o in serial for c in o["outputs"]
    }
    assert reasons == {("length", "NoneType"), ("stop", "str"), ("stop", "int")}
    # the generation counter counts kept tokens, not the ones computed past an end
    kept = sum(len(c["token_ids"]) for o in serial for c in o["outputs"])
    assert async_stats["generation_tokens"] == serial_stats["generation_tokens"] == kept


def test_async_stream_matches_serial_generate(ckpt_tied, stop_workload, serial_run):
    prompts, params = stop_workload
    serial, _ = serial_run
    with make_llm(ckpt_tied.path, True) as llm:
        pieces: dict[tuple[int, int], list] = {}
        for inc in llm.stream(prompts, params):
            got = pieces.setdefault((inc["index"], inc["completion"]), [[], "", None])
            assert got[2] is None, "an increment after the final one"
            got[0] += inc["token_ids"]
            got[1] += inc["text"]
            if inc["finished"]:
                got[2] = inc["finish_reason"]
        assert llm.is_finished()
    for i, out in enumerate(serial[: len(prompts)]):
        for j, c in enumerate(out["outputs"]):
            assert pieces[(i, j)] == [c["token_ids"], c["text"], c["finish_reason"]], (
                f"prompts[{i}] completion {j}"
            )


def test_step_by_step_resolves_one_step_late(ckpt_tied):
    """With add_request/step: a step's finished requests are reported by the next step, and the
    engine is idle (nothing in flight, every block free) once they all are."""
    prompts = random_prompts(204, [7, 20])
    with make_llm(ckpt_tied.path, True, num_kvcache_blocks=64) as llm:
        ids = [
            llm.add_request(p, SamplingParams(temperature=0, max_tokens=m))
            for p, m in zip(prompts, (1, 3))
        ]
        steps = []
        while not llm.is_finished():
            outputs, num_tokens = llm.step()
            steps.append((sorted(seq_id for seq_id, _ in outputs), num_tokens))
        assert llm.get_stats()["kv_cache_usage"] == 0.0
    with make_llm(ckpt_tied.path, False, num_kvcache_blocks=64) as llm:
        expected = {
            llm.add_request(p, SamplingParams(temperature=0, max_tokens=m)): None
            for p, m in zip(prompts, (1, 3))
        }
        serial = []
        while not llm.is_finished():
            outputs, num_tokens = llm.step()
            serial.append((sorted(seq_id for seq_id, _ in outputs), num_tokens))
    a, b = ids
    a2, b2 = expected
    # serial: prefill finishes a (max_tokens 1); two decodes finish b
    assert serial == [([a2], 27), ([], -1), ([b2], -1)]
    # async: a's only token arrives with the next step; b's last decode is reported by a step
    # that launches nothing
    assert steps == [([], 27), ([a], -1), ([], -1), ([b], 0)]


def test_tp2_async_matches_one_rank_serial(ckpt_tied, stop_workload, serial_run):
    prompts, params = stop_workload
    serial, _ = serial_run
    overlapped, _ = run(ckpt_tied.path, prompts, params, True, tensor_parallel_size=2)
    # two ranks sum their partial results in another order: logprobs agree to float32 rounding
    assert comparable(overlapped) == comparable(serial)
    assert_logprobs_close(overlapped, serial, tol=1e-4)
