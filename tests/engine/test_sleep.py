"""Sleep mode on the CPU (float32): greedy outputs match transformers before ``sleep``; while asleep
the KV cache, the step buffers and every parameter's storage are gone on rank 0 (buffers such as the
rotary cos/sin caches kept on the host) and the model calls are refused; after ``sleep(1)`` and
``wake_up()`` the outputs are the same token for token, after ``sleep(2)``, ``wake_up()`` and
``update_weights`` with the checkpoint's tensors too; the prefix cache is dropped. For Qwen3 and
Qwen3-MoE on one rank, Qwen3 on two ranks (gloo) and through two data-parallel replicas; bad values
and states (with async scheduling off); an engine that exits asleep."""

import os

import pytest
import torch
from hf_reference import VOCAB_SIZE, assert_greedy_match, random_prompts
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import make_random_checkpoint

TINY = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=VOCAB_SIZE + 1,
)
FAMILIES = {
    "qwen3": dict(shape="tiny", tie_word_embeddings=False),
    "qwen3_moe": dict(
        shape="qwen3-30b-a3b",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
}
CPU = dict(
    device="cpu",
    kvcache_block_size=16,
    num_kvcache_blocks=64,
    max_model_len=256,
    enable_sleep_mode=True,
)
PROMPTS = random_prompts(7, [40, 7, 20, 33])
HITS = [32, 0, 16, 32]  # prompt tokens the prefix cache serves when PROMPTS run again
COLD = [0] * len(PROMPTS)
GREEDY = SamplingParams(temperature=0, max_tokens=6)
ASLEEP = r"the engine is asleep; call wake_up\(\)"


def build(root, family: str) -> str:
    variant = dict(FAMILIES[family])
    return make_random_checkpoint(
        str(root / family),
        variant.pop("shape"),
        dtype=torch.float32,
        seed=3,
        std=0.3,
        **(TINY | variant),
    )


def tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def generate(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Greedy completions of PROMPTS, and how many prompt tokens the prefix cache served each."""
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o["token_ids"] for o in outputs], [o["num_cached_tokens"] for o in outputs]


def checkpoint_and_reference(root, family: str, hf_ref) -> tuple[str, list]:
    """A family's checkpoint and its transformers greedy completions of PROMPTS."""
    path = build(root, family)
    return path, [hf_ref.greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, hf_ref):
    return checkpoint_and_reference(tmp_path_factory.mktemp("sleep"), "qwen3", hf_ref)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, hf_ref):
    return checkpoint_and_reference(tmp_path_factory.mktemp("sleep"), "qwen3_moe", hf_ref)


def warm(llm: LLM, want) -> list[list[int]]:
    """PROMPTS twice: the reference's tokens, the second time from the prefix cache."""
    out, _ = generate(llm)
    for i, (got, ref) in enumerate(zip(out, want)):
        assert_greedy_match(got, ref, f"prompt {i}")
    assert generate(llm) == (out, HITS)
    return out


def assert_asleep(llm: LLM, level: int) -> None:
    """Rank 0 holds no KV cache, no step buffers, no graphs, and no parameter storage; the model
    calls are refused and queue nothing. Its buffers (rotary cos/sin) are kept on the host."""
    runner = llm.core.executor.runner
    assert llm.is_sleeping()
    assert (runner.kv_cache, runner.graphs, runner.sampled, runner.decode_buffer) == (
        None,
        None,
        None,
        None,
    )
    layers = [m for m in runner.model.modules() if hasattr(m, "k_cache")]
    assert len(layers) == 2 and all(m.k_cache.numel() == m.v_cache.numel() == 0 for m in layers)
    params = list(runner.model.parameters())
    assert params and all(p.untyped_storage().nbytes() == 0 for p in params)
    assert all(b.untyped_storage().nbytes() == 0 for b in runner.model.buffers())
    kept = {id(view[0]): e.host for e in runner.offloaded for view in e.views}
    assert all((kept[id(p)] is not None) == (level == 1) for p in params)
    assert all(kept[id(b)] is not None for b in runner.model.buffers())
    for call in (
        lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False),
        lambda: llm.add_request(PROMPTS[0], GREEDY),
        lambda: llm.stream(PROMPTS, GREEDY),
        lambda: llm.step(),
        lambda: llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False),
        lambda: llm.update_weights({}),
    ):
        with pytest.raises(RuntimeError, match=ASLEEP):
            call()
    stats = llm.get_stats()
    assert (stats["num_requests_waiting"], stats["num_requests_running"]) == (0, 0)


def test_sleep_and_wake_up_keep_the_outputs(qwen3):
    """Level 1: the weights come back from the host. Level 2: they come back zeroed (the model then
    answers differently) and ``update_weights`` with the checkpoint's tensors restores the outputs.
    The buffers come back with their values; the prefix cache is dropped at each sleep."""
    path, want = qwen3
    with LLM(path, **CPU) as llm:
        runner = llm.core.executor.runner
        out = warm(llm, want)
        blocks = runner.kv_cache.shape
        buffers = [b.clone() for b in runner.model.buffers()]
        llm.sleep(1)
        assert_asleep(llm, 1)
        llm.wake_up()
        assert not llm.is_sleeping() and runner.kv_cache.shape == blocks
        assert all(torch.equal(a, b) for a, b in zip(runner.model.buffers(), buffers, strict=True))
        assert generate(llm) == (out, COLD)
        assert generate(llm) == (out, HITS)
        llm.sleep(level=2)
        assert_asleep(llm, 2)
        llm.wake_up()
        assert runner.kv_cache.shape == blocks
        assert all(torch.equal(a, b) for a, b in zip(runner.model.buffers(), buffers, strict=True))
        assert generate(llm)[0] != out  # the weights were dropped
        llm.update_weights(tensors(path).items())
        assert generate(llm) == (out, COLD)


def test_bad_values_and_states(qwen3):
    """Sleep mode off, bad levels, a stream being read, sleeping twice: errors (a queued request is
    aborted, vLLM's mode "abort")
    that change nothing; ``wake_up`` while awake does nothing. The engine keeps serving
    throughout."""
    path, want = qwen3
    with pytest.raises(TypeError, match=r"Config\.enable_sleep_mode must be a bool, got 'yes'"):
        LLM(path, **(CPU | {"enable_sleep_mode": "yes"}))
    with LLM(path, **(CPU | {"enable_sleep_mode": False})) as llm:
        with pytest.raises(
            RuntimeError,
            match=r"sleep\(\) needs sleep mode: create the LLM with enable_sleep_mode=True",
        ):
            llm.sleep(1)
    with LLM(path, **(CPU | {"async_scheduling": False})) as llm:
        out = warm(llm, want)
        for level, error in (
            (0, ValueError),
            (3, ValueError),
            (True, TypeError),
            ("1", TypeError),
            (1.0, TypeError),
        ):
            with pytest.raises(
                error,
                match=rf"sleep level must be (an int \(1 or 2\)|1 \(weights kept on the host\)"
                rf" or 2 \(weights dropped\)), got {level!r}",
            ):
                llm.sleep(level)
        llm.wake_up()  # awake: nothing happens
        assert not llm.is_sleeping() and generate(llm) == (out, HITS)

        llm.add_request(PROMPTS[0], GREEDY)
        llm.sleep(1)  # mode "abort", vLLM's default: the queued request ends
        assert llm.wake_up() is True and llm.is_finished() and llm.step() == ([], 0)

        stream = llm.stream(PROMPTS, GREEDY)
        got = {}
        for inc in stream:
            got[inc["index"]] = got.get(inc["index"], []) + inc["token_ids"]
            if len(got) == 1 and not inc["finished"]:
                with pytest.raises(RuntimeError, match=r"sleep needs an idle engine"):
                    llm.sleep(2)
        assert [got[i] for i in range(len(PROMPTS))] == out

        llm.sleep(1)
        with pytest.raises(
            RuntimeError, match=r"the engine is already asleep \(level 1\); call wake_up\(\) first"
        ):
            llm.sleep(2)
        assert llm.reset_prefix_cache() is True  # allowed while asleep
        llm.wake_up()
        assert generate(llm) == (out, COLD)
    with pytest.raises(RuntimeError, match="has exited"):
        llm.sleep(1)


def sleep_both_levels(llm: LLM, path: str, want) -> None:
    """Level 1 and 2, each with a wake-up: the reference's tokens before, the same tokens after."""
    out, _ = generate(llm)
    for i, (got, ref) in enumerate(zip(out, want)):
        assert_greedy_match(got, ref, f"prompt {i}")
    llm.sleep(1)
    with pytest.raises(RuntimeError, match=ASLEEP):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert generate(llm) == (out, COLD)
    llm.sleep(2)
    llm.wake_up()
    llm.update_weights(tensors(path))
    assert generate(llm) == (out, COLD)
    llm.sleep(1)  # and the engine exits asleep


def test_tensor_parallel_ranks_sleep_too(qwen3):
    """Two ranks (gloo): each frees and restores its shard, the worker told through the control
    channel."""
    path, want = qwen3
    with LLM(path, tensor_parallel_size=2, **CPU) as llm:
        sleep_both_levels(llm, path, want)


def test_data_parallel_replicas_sleep_too(qwen3):
    """Two replicas (processes): each sleeps and wakes through a control call."""
    path, want = qwen3
    with LLM(path, data_parallel_size=2, **CPU) as llm:
        sleep_both_levels(llm, path, want)
        assert (
            all(r["generation_tokens"] > 0 for r in llm.get_stats()["replicas"])
            and llm.is_sleeping()
        )


def test_moe_experts_sleep_too(qwen3_moe):
    """Qwen3-MoE (a sparse layer's router and stacked experts, a dense layer): level 2 frees every
    parameter, and the checkpoint's per-expert tensors restore the reference's tokens."""
    path, want = qwen3_moe
    with LLM(path, **CPU) as llm:
        out, _ = generate(llm)
        for i, (got, ref) in enumerate(zip(out, want)):
            assert_greedy_match(got, ref, f"prompt {i}")
        llm.sleep(2)
        assert_asleep(llm, 2)
        llm.wake_up()
        llm.update_weights(tensors(path))
        assert generate(llm) == (out, COLD)
