"""Data-parallel replicas as Ray actors, on a local Ray cluster of CPUs: the tokens one engine
gives (greedy, seeded, streamed), every replica idle after an early break, weight updates and
prefix-cache resets on every actor, and an actor that dies is a clear error."""

import os
import threading

import pytest
import torch
from dp_helpers import assert_idle, seeded_params, streamed, summary, workload
from hf_reference import BLOCK_SIZE, random_prompts
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams

ray = pytest.importorskip("ray")

CPU = dict(
    device="cpu",
    kvcache_block_size=BLOCK_SIZE,
    num_kvcache_blocks=64,
    max_model_len=256,
    max_num_batched_tokens=64,
)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_replicas_give_what_one_engine_gives(cluster, ckpt_tied):
    prompts, params = workload()
    seeded_prompts = random_prompts(3, [5, 18, 33, 7])
    seeded = seeded_params(len(seeded_prompts))
    results = []
    for kwargs in ({}, dict(data_parallel_size=2, data_parallel_backend="ray")):
        with LLM(ckpt_tied.path, **CPU | kwargs) as llm:
            results.append(
                [
                    summary(llm.generate(prompts, params, use_tqdm=False)),
                    summary(llm.generate(seeded_prompts, seeded, use_tqdm=False)),
                    streamed(llm, prompts, params),
                ]
            )
            if kwargs:
                assert [len(r["replicas"]) for r in [llm.get_stats()]] == [2]
                assert all(r["generation_tokens"] > 0 for r in llm.get_stats()["replicas"])
                for _ in llm.stream(
                    prompts, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
                ):
                    break
                assert_idle(llm)
                check_controls(llm, ckpt_tied.path, prompts, params, results[0][0])
    assert results[1] == results[0]
    assert results[0][2] == results[0][0]  # the stream concatenates to generate's outputs


def check_controls(llm: LLM, path: str, prompts, params, want) -> None:
    """Weight updates and prefix-cache resets reach every actor: a zero final norm makes every
    logit 0 (greedy token 0 everywhere), the checkpoint's own tensor brings the tokens back."""
    fresh, greedy = random_prompts(7, [40, 33]), SamplingParams(temperature=0, max_tokens=4)
    cached = [
        [o["num_cached_tokens"] for o in llm.generate(fresh, greedy, use_tqdm=False)]
        for _ in range(2)
    ]
    assert llm.reset_prefix_cache() is True
    cached.append([o["num_cached_tokens"] for o in llm.generate(fresh, greedy, use_tqdm=False)])
    assert cached == [[0, 0], [32, 32], [0, 0]]
    norm = load_file(os.path.join(path, "model.safetensors"))["model.norm.weight"]
    llm.update_weights([("model.norm.weight", torch.zeros_like(norm))])
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert {t for o in outputs for c in o["outputs"] for t in c["token_ids"]} == {0}
    llm.update_weights({"model.norm.weight": norm})
    assert summary(llm.generate(prompts, params, use_tqdm=False)) == want


def test_a_dead_actor_is_a_clear_error(cluster, ckpt_tied):
    llm = LLM(ckpt_tied.path, data_parallel_size=2, data_parallel_backend="ray", **CPU)
    victim = llm.core.replicas[1].actor
    threading.Timer(1.0, ray.kill, (victim,)).start()
    with pytest.raises(
        RuntimeError,
        match=r"(?s)data-parallel replica 1 \(Ray actor\) died.*the engine has stopped",
    ):
        for _ in range(1000):
            llm.generate(
                [[1 + i, 2, 3] * 10 for i in range(4)],
                SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                use_tqdm=False,
            )
    llm.exit()
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )
