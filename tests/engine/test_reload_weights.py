"""``collective_rpc("update_config", ...)`` then ``collective_rpc("reload_weights")`` after
``load_format="dummy"``: the greedy tokens of an engine that loaded the checkpoint, on one rank and
two (gloo); bad names and overrides raise and change nothing."""

import pytest
from hf_reference import random_prompts

from nanovllm import LLM, SamplingParams

CPU = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
PROMPTS = random_prompts(3, [40, 7, 20])
GREEDY = SamplingParams(temperature=0, max_tokens=6)
AUTO = ({"load_config": {"load_format": "auto"}},)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def loaded(ckpt_tied) -> list[list[int]]:
    with LLM(ckpt_tied.path, **CPU) as llm:
        return tokens(llm)


@pytest.mark.parametrize("tp", [1, 2])
def test_reload_after_dummy_gives_the_checkpoint_tokens(ckpt_tied, loaded, tp):
    with LLM(ckpt_tied.path, load_format="dummy", tensor_parallel_size=tp, **CPU) as llm:
        assert tokens(llm) != loaded
        assert llm.collective_rpc("update_config", args=AUTO) == [None]
        assert llm.config.load_format == "auto"
        llm.collective_rpc("reload_weights")
        assert tokens(llm) == loaded
        llm.collective_rpc("update_config", args=({"load_config": {"load_format": "dummy"}},))
        llm.collective_rpc("reload_weights")  # dummy weights drawn again: the dummy tokens
        dummy = tokens(llm)
        assert dummy != loaded


def test_bad_calls_change_nothing(ckpt_tied, loaded):
    with LLM(ckpt_tied.path, **CPU) as llm:
        for args, message in (
            (({"model_config": {}},), r"update_config: only \{'load_config'"),
            (({"load_config": {"load_format": "gguf"}},), r"load_format must be one of"),
        ):
            with pytest.raises(ValueError, match=message):
                llm.collective_rpc("update_config", args=args)
        with pytest.raises(TypeError, match=r"update_config takes a dict of overrides, got str"):
            llm.collective_rpc("update_config", args=("x",))
        with pytest.raises(ValueError, match=r"collective_rpc: unknown method 'nope'; known:"):
            llm.collective_rpc("nope")
        with pytest.raises(ValueError, match=r"reload_weights takes no arguments here"):
            llm.collective_rpc("reload_weights", args=(1,))
        with pytest.raises(ValueError, match=r"timeout must be None here \(no limit\), got 5"):
            llm.collective_rpc("reload_weights", timeout=5)
        llm.add_request(PROMPTS[0], GREEDY)
        with pytest.raises(RuntimeError, match=r"reload_weights needs an idle engine"):
            llm.collective_rpc("reload_weights")
        while not llm.is_finished():
            llm.step()
        assert llm.collective_rpc(lambda runner: runner.rank) == [0]  # functions as before
        llm.collective_rpc("reload_weights")
        assert tokens(llm) == loaded
