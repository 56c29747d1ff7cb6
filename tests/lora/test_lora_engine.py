"""Adapters through the engine's paths (tiny Qwen3, float32, CPU, against PEFT): chunked prefill,
preemption, prefix-cache hits keyed by adapter, max_loras=1 serialising two adapters (later
requests passing one that waits for the slot), and an
adapter replaced from tensors in memory with no stale prefix-cache hit."""

import pytest
from hf_reference import assert_greedy_match, greedy_logprobs
from lora_helpers import adapter_tensors, build_base, make_llm, peft_model, prompts, save_adapter

from nanovllm import SamplingParams
from nanovllm.lora.request import LoRARequest

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    base = build_base(str(root / "base"), "qwen3", seed=4)
    models = [peft_model(base, seed) for seed in (21, 22)]
    folders = [save_adapter(m, str(root / f"a{i}")) for i, m in enumerate(models)]
    refs = [[greedy_logprobs(m, p, MAX_TOKENS)[0] for p in prompts()] for m in models]
    return base, models, folders, refs


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_chunked_prefill_and_preemption_keep_each_adapter(setup):
    base, _, folders, refs = setup
    loras = [LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(folders)]
    # 16-token chunks, and a cache of 8 blocks for 10 sequences of up to 4 blocks: preemption
    llm = make_llm(base, max_num_batched_tokens=16, num_kvcache_blocks=8, max_model_len=64)
    try:
        rows = [(p, i) for i in (0, 1) for p in range(len(prompts()))]
        outs = llm.generate(
            [prompts()[p] for p, _ in rows], greedy(), False, [loras[i] for _, i in rows]
        )
        for out, (p, i) in zip(outs, rows):
            assert_greedy_match(out.outputs[0].token_ids, refs[i][p], f"adapter {i}, prompt {p}")
        assert llm.get_stats()["num_preemptions"] > 0
    finally:
        llm.exit()


def test_prefix_cache_hits_only_within_one_adapter(setup):
    base, _, folders, refs = setup
    llm = make_llm(base)
    try:
        a0, a1 = (LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(folders))
        prompt = prompts()[3]  # 40 tokens: two full blocks can be hit
        first = llm.generate([prompt], greedy(), False, a0)[0]
        again = llm.generate([prompt], greedy(), False, a0)[0]
        other = llm.generate([prompt], greedy(), False, a1)[0]
        plain = llm.generate([prompt], greedy(), False)[0]
        assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
        assert (other.num_cached_tokens, plain.num_cached_tokens) == (0, 0)
        assert tokens([first]) == tokens([again])
        assert_greedy_match(other.outputs[0].token_ids, refs[1][3], "adapter 1 after adapter 0")
        bm = llm.core.scheduler.block_manager  # 3 prefixes of 2 full blocks each, none shared
        assert len(bm.hash_to_block_id) >= 6
    finally:
        llm.exit()


def test_max_loras_one_serialises_two_adapters(setup):
    base, _, folders, refs = setup
    llm = make_llm(base, max_loras=1)
    try:
        seen = []  # the adapter slots of every step
        run = llm.core.executor.run
        llm.core.executor.run = lambda step: seen.append(step.adapters) or run(step)
        loras = [LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(folders)]
        first = llm.add_request(prompts()[0], greedy(), loras[0])
        second = llm.add_request(prompts()[1], greedy(), loras[1])
        plain = llm.add_request(prompts()[2], greedy())
        same = llm.add_request(prompts()[3], greedy(), loras[0])
        llm.step()
        running = {s.request_id for s in llm.core.scheduler.running}
        assert running == {first, plain, same}  # the second adapter waits; the others pass it
        assert [s.request_id for s in llm.core.scheduler.waiting] == [second]
        done = {}
        while not llm.is_finished():
            done.update(llm.step()[0])
        assert_greedy_match(done[first], refs[0][0], "first adapter")
        assert_greedy_match(done[second], refs[1][1], "second adapter")
        assert_greedy_match(done[same], refs[0][3], "first adapter, a later request")
        assert all(a is None or len(set(a) - {-1}) == 1 for a in seen)  # one adapter a step
        assert any(a is not None and -1 in a for a in seen)  # the base rows ran beside it
        assert llm.core.shared["lora"].slots == [2]
    finally:
        llm.exit()


def test_adapter_replaced_from_tensors_gives_the_new_tokens(setup):
    base, models, _, refs = setup
    llm = make_llm(base)
    try:
        prompt = prompts()[3]
        old, new = (adapter_tensors(m) for m in models)
        out = llm.generate(
            [prompt], greedy(), False, LoRARequest("rl", 7, lora_tensors=old[0], peft_config=old[1])
        )
        assert_greedy_match(out[0].outputs[0].token_ids, refs[0][3], "version 1")
        # the same id without load_inplace: the loaded adapter stays (vLLM's rule)
        same = LoRARequest("rl", 7, lora_tensors=new[0], peft_config=new[1])
        assert tokens(llm.generate([prompt], greedy(), False, same)) == tokens(out)
        replaced = LoRARequest("rl", 7, lora_tensors=new[0], peft_config=new[1], load_inplace=True)
        out = llm.generate([prompt], greedy(), False, replaced)
        assert out[0].num_cached_tokens == 0  # no block of version 1 is hit
        assert_greedy_match(out[0].outputs[0].token_ids, refs[1][3], "version 2")
        again = llm.generate(
            [prompt], greedy(), False, LoRARequest("rl", 7, lora_tensors=new[0], peft_config=new[1])
        )
        assert again[0].num_cached_tokens == 32 and tokens(again) == tokens(out)
    finally:
        llm.exit()


def test_host_cache_limit_pinning_and_removal(setup):
    base, models, folders, _ = setup
    llm = make_llm(base, max_loras=2, max_cpu_loras=2)
    try:
        tensors, config = adapter_tensors(models[0])
        for i in (1, 2):
            assert llm.add_lora(LoRARequest(f"t{i}", i, lora_tensors=tensors, peft_config=config))
        assert llm.pin_lora(1)
        llm.add_lora(LoRARequest("t3", 3, folders[1]))
        assert llm.list_loras() == {1, 3}  # 2 was the least recently used unpinned one
        assert llm.remove_lora(3) and not llm.remove_lora(3)
        assert llm.list_loras() == {1}
        with pytest.raises(ValueError, match="add_lora"):
            llm.pin_lora(9)
    finally:
        llm.exit()
