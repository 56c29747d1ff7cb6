"""vLLM's ``sleep(level, mode)`` and ``wake_up(tags)`` on the CPU: ``abort`` ends queued requests,
``wait`` finishes them first (``step()`` still hands them out), ``keep`` recomputes them after
waking with the same tokens; ``wake_up(["weights"])`` then ``["kv_cache"]`` wake in parts, with
weights reloaded between; bad modes, tags and level 0 raise."""

import pytest
from hf_reference import random_prompts

from nanovllm import LLM, SamplingParams

CPU = dict(
    device="cpu",
    kvcache_block_size=16,
    num_kvcache_blocks=64,
    max_model_len=256,
    enable_sleep_mode=True,
)
PROMPTS = random_prompts(4, [40, 7, 20])
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def drain(llm: LLM) -> dict:
    done = {}
    while not llm.is_finished():
        done.update(llm.step()[0])
    return done


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_modes(ckpt_tied, async_scheduling):
    with LLM(ckpt_tied.path, async_scheduling=async_scheduling, **CPU) as llm:
        want = tokens(llm)
        ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
        llm.step()
        llm.sleep(1)  # mode "abort"
        assert llm.is_sleeping() and llm.wake_up() is True
        assert drain(llm) == {} and llm.get_stats()["num_requests_waiting"] == 0

        ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
        llm.step()
        llm.sleep(1, mode="wait")
        assert llm.wake_up() and drain(llm) == dict(zip(ids, want))

        ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
        llm.step()
        llm.step()
        llm.sleep(2, mode="keep")
        with pytest.raises(RuntimeError, match=r"the engine is asleep; call wake_up\(\)"):
            llm.step()
        assert llm.wake_up(tags=["weights"]) is False and llm.is_sleeping()
        llm.collective_rpc("reload_weights")  # level 2 dropped them
        assert llm.wake_up(tags=["scheduling", "kv_cache"]) is True
        assert drain(llm) == dict(zip(ids, want))
        assert tokens(llm) == want


def test_tags_and_bad_values(ckpt_tied):
    with LLM(ckpt_tied.path, **CPU) as llm:
        want = tokens(llm)
        llm.sleep(1)
        assert llm.wake_up(tags=["kv_cache"]) is False  # weights still on the host
        with pytest.raises(RuntimeError, match=r"the engine is asleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.wake_up(tags=["weights"]) is True and tokens(llm) == want
        with pytest.raises(ValueError, match=r"sleep mode must be one of .*, got 'later'"):
            llm.sleep(1, mode="later")
        with pytest.raises(ValueError, match=r"pausing the scheduler, is not supported here"):
            llm.sleep(0)
        llm.sleep(2)
        with pytest.raises(ValueError, match=r"wake_up tags must be None .*, got \['all'\]"):
            llm.wake_up(tags=["all"])
        with pytest.raises(RuntimeError, match=r"the engine is asleep"):
            llm.collective_rpc("reload_weights")  # the weights are not back yet
        assert llm.wake_up() is True
        llm.collective_rpc("reload_weights")
        assert tokens(llm) == want
