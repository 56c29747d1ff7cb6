"""lora_request through every front end (chat, stream, the original step loop, vLLM's LLMEngine,
AsyncLLM with a cancelled stream) and over tensor and data parallelism: the adapter's tokens."""

import asyncio

import pytest
from hf_reference import greedy_logprobs
from lora_helpers import build_base, make_llm, peft_model, prompts, save_adapter

from nanovllm import SamplingParams
from nanovllm.lora.request import LoRARequest

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-frontends")
    base = build_base(str(root / "base"), "qwen3", seed=6)
    models = [peft_model(base, seed) for seed in (41, 42)]
    loras = [
        LoRARequest(f"a{i}", i + 1, save_adapter(m, str(root / f"a{i}")))
        for i, m in enumerate(models)
    ]
    refs = [[greedy_logprobs(m, p, MAX_TOKENS)[0].tokens for p in prompts()] for m in models]
    with models[0].disable_adapter():
        refs.append([greedy_logprobs(models[0], p, MAX_TOKENS)[0].tokens for p in prompts()])
    return base, loras, refs  # refs[2]: the base model


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def test_stream_step_loop_and_vllm_llm_engine(setup):
    from nanovllm.entrypoints.llm_engine import LLMEngine

    base, loras, refs = setup
    llm = make_llm(base)
    try:
        pieces = {}
        for piece in llm.stream(prompts()[:2], greedy(), lora_request=[loras[1], None]):
            pieces.setdefault(piece["index"], []).extend(piece["token_ids"])
        assert pieces == {0: refs[1][0], 1: refs[2][1]}
        request_id = llm.add_request(prompts()[2], greedy(), loras[0])
        done = {}
        while not llm.is_finished():
            done.update(llm.step()[0])
        assert done[request_id] == refs[0][2]
    finally:
        llm.exit()
    engine = LLMEngine(base, enable_lora=True, max_loras=1, max_lora_rank=8, device="cpu")
    try:
        engine.add_request("x", prompts()[0], greedy(), lora_request=loras[0])
        engine.add_request("y", prompts()[1], greedy(), lora_request=loras[1])
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.lora_request == loras[out.request_id == "y"]
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
        assert finished == {"x": refs[0][0], "y": refs[1][1]}
        assert engine.list_loras() == {1, 2}
    finally:
        engine.exit()


def test_chat_with_an_adapter(tmp_path):
    """The real vocabulary (a chat template's tokens), and an adapter given as tensors."""
    from transformers import AutoConfig

    from nanovllm.lora.random_adapter import random_adapter
    from nanovllm.utils.checkpoint import make_random_checkpoint

    base = make_random_checkpoint(str(tmp_path), "tiny", std=0.3)
    tensors, config = random_adapter(AutoConfig.from_pretrained(base), rank=8, std=0.5)
    lora = LoRARequest("t", 1, lora_tensors=tensors, peft_config=config)
    llm = make_llm(base, max_lora_rank=8)
    try:
        chat = [{"role": "user", "content": "Hello there"}]
        out = llm.chat(chat, greedy(), use_tqdm=False, lora_request=lora)[0]
        alone = llm.generate([out.prompt_token_ids], greedy(), False, lora)[0]
        plain = llm.generate([out.prompt_token_ids], greedy(), False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.outputs[0].token_ids != plain.outputs[0].token_ids
    finally:
        llm.exit()


def test_async_llm_streams_with_adapters(setup):
    from nanovllm.entrypoints.async_llm import AsyncLLM

    base, loras, refs = setup
    engine = AsyncLLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu")

    async def one(request_id, prompt, lora):
        async for out in engine.generate(prompt, greedy(), request_id, lora_request=lora):
            last = out
        return last.outputs[0].token_ids

    async def cancelled():
        async for _ in engine.generate(prompts()[3], greedy(), "c", lora_request=loras[1]):
            break  # leaving the loop aborts the request and frees its slot

    async def main():
        await cancelled()
        jobs = [one(str(i), prompts()[i], [loras[0], loras[1], None][i]) for i in range(3)]
        got = await asyncio.gather(*jobs)
        assert await engine.list_loras() == {1, 2}
        return got

    try:
        got = asyncio.run(main())
        assert got == [refs[0][0], refs[1][1], refs[2][2]]
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "parallel", [dict(tensor_parallel_size=2), dict(data_parallel_size=2)], ids=["tp2", "dp2"]
)
def test_tensor_and_data_parallel_equal_one_rank(setup, parallel):
    base, loras, refs = setup
    rows = [(p, i) for p in range(len(prompts())) for i in (0, 1, 2)]
    llm = make_llm(base, max_loras=2, max_lora_rank=8, **parallel)
    try:
        outs = llm.generate(
            [prompts()[p] for p, _ in rows],
            greedy(),
            False,
            [loras[i] if i < 2 else None for _, i in rows],
        )
        assert [o.outputs[0].token_ids for o in outs] == [refs[i][p] for p, i in rows]
        assert llm.list_loras() == {1, 2}
    finally:
        llm.exit()
