"""vLLM's ``LLMEngine``: string request ids, ``step()``'s outputs as each request's
``output_kind`` asks (exact tokens against ``LLM.generate``), aborts, duplicate ids, and
``reset_prefix_cache(reset_running_requests=True)`` while requests run."""

import pytest
from hf_reference import BLOCK_SIZE

from nanovllm import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

PROMPTS = [list(range(10, 40)), [7, 8, 9], list(range(10, 40)) + [5, 6]]
MAX_TOKENS = [12, 9, 14]


def params(i: int, kind=RequestOutputKind.CUMULATIVE, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], output_kind=kind, **kw)


@pytest.fixture(scope="module")
def engine(ckpt_tied):
    args = EngineArgs(ckpt_tied.path, device="cpu", block_size=BLOCK_SIZE, num_kvcache_blocks=48)
    engine = LLMEngine.from_engine_args(args)
    yield engine
    engine.exit()


@pytest.fixture(scope="module")
def reference(engine):
    outs = engine.llm.generate(PROMPTS, [params(i) for i in range(3)], use_tqdm=False)
    return [o.outputs[0] for o in outs]


def run(engine, kind) -> dict[str, list]:
    for i, prompt in enumerate(PROMPTS):
        assert engine.add_request(f"r{i}", prompt, params(i, kind)) == f"r{i}"
    seen: dict[str, list] = {f"r{i}": [] for i in range(3)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert engine.step() == []
    return seen


def test_cumulative(engine, reference):
    for i, (request_id, outs) in enumerate(run(engine, RequestOutputKind.CUMULATIVE).items()):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(set(lengths))  # it grows every time it is reported
        for out in outs:
            assert out.prompt_token_ids == PROMPTS[i]
            assert (
                out.outputs[0].token_ids == reference[i].token_ids[: len(out.outputs[0].token_ids)]
            )
        assert outs[-1].outputs[0].text == reference[i].text
        assert outs[-1].outputs[0].finish_reason == "length"


def test_cumulative_text_only_grows_with_a_stop_string(engine, reference):
    """Text that may begin a stop string is held back, so every output's text is a prefix of the
    next one's and of the final text (which the stop string cut)."""
    full = reference[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    engine.add_request("s", PROMPTS[0], params(0, stop=[stop]))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert texts[-1] == full[: full.index(stop)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_delta(engine, reference):
    for i, outs in enumerate(run(engine, RequestOutputKind.DELTA).values()):
        assert all(o.outputs[0].token_ids for o in outs) and outs[-1].finished
        assert sum((o.outputs[0].token_ids for o in outs), []) == reference[i].token_ids
        assert "".join(o.outputs[0].text for o in outs) == reference[i].text


def test_final_only(engine, reference):
    for i, outs in enumerate(run(engine, RequestOutputKind.FINAL_ONLY).values()):
        assert len(outs) == 1 and outs[0].finished
        assert outs[0].outputs[0].token_ids == reference[i].token_ids
        assert outs[0].outputs[0].text == reference[i].text


def test_delta_logprobs_and_prompt_logprobs_once(engine):
    sp = params(0, RequestOutputKind.DELTA, logprobs=1, prompt_logprobs=1)
    engine.add_request("lp", PROMPTS[0], sp)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs[0].prompt_logprobs) == len(PROMPTS[0])
    assert all(o.prompt_logprobs is None for o in outs[1:])
    for out in outs:
        c = out.outputs[0]
        assert [next(iter(e)) for e in c.logprobs] == c.token_ids  # greedy: the top one


def test_abort_duplicate_and_bad_ids(engine, reference):
    long = SamplingParams(temperature=0, max_tokens=40)
    engine.add_request("x", PROMPTS[1], long)
    engine.add_request("y", PROMPTS[1], params(1))
    with pytest.raises(ValueError, match="request_id 'x' is in use by an unfinished request"):
        engine.add_request("x", PROMPTS[0], long)
    with pytest.raises(TypeError, match="request_id must be a str, got int"):
        engine.add_request(3, PROMPTS[0], long)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        engine.add_request("z", PROMPTS[0], long, lora_request=object())
    engine.step()
    engine.step()
    engine.abort_request(["x", "no-such-id"])
    assert engine.get_num_unfinished_requests() == 1
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"y"}
    assert outs[-1].outputs[0].token_ids == reference[1].token_ids
    engine.add_request("x", PROMPTS[1], params(1))  # a finished or aborted id may come back
    engine.abort_request("x")
    assert not engine.has_unfinished_requests() and engine.llm.core.is_finished()
    assert engine.llm.outputs.requests == {} and engine.llm._owned == set()


@pytest.mark.parametrize("replicas", [1, 2])
def test_reset_prefix_cache_with_running_requests(engine, reference, ckpt_tied, replicas):
    if replicas == 2:
        engine = LLMEngine(
            ckpt_tied.path, device="cpu", block_size=BLOCK_SIZE, data_parallel_size=2
        )
    try:
        reset_while_running(engine, reference)
    finally:
        if replicas == 2:
            engine.exit()


def reset_while_running(engine, reference):
    assert engine.reset_prefix_cache()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params(i, RequestOutputKind.FINAL_ONLY))
    outs = []
    # until every request runs: a data-parallel replica's counts are those of its last reply,
    # and a slow replica's first one may come several steps after the other's (no request can
    # finish in 8 steps: each asks for 9 or more tokens)
    for _ in range(8):
        outs += engine.step()
        stats = engine.llm.get_stats()
        if stats["num_requests_running"] == 3:
            break
    assert stats["kv_cache_usage"] > 0 and stats["num_requests_running"] == 3
    assert engine.reset_prefix_cache(reset_running_requests=True)
    after = engine.llm.get_stats()
    assert after["kv_cache_usage"] == 0  # every block freed
    assert after["num_preemptions"] == stats["num_preemptions"] + 3
    if hasattr(engine.llm.core, "scheduler"):
        assert engine.llm.core.scheduler.block_manager.hash_to_block_id == {}  # none cached
    while engine.has_unfinished_requests():
        outs += engine.step()
    got = {o.request_id: o.outputs[0].token_ids for o in outs}
    assert got == {f"r{i}": reference[i].token_ids for i in range(3)}


def test_tokenizer_and_rpc(engine):
    assert engine.get_tokenizer() is engine.llm.tokenizer
    assert engine.collective_rpc(lambda runner: runner.rank) == [0]
