"""Bad input raises the right exception with a message naming the field or the prompt, and a
failed ``generate`` queues nothing: the engine goes on serving correct (transformers-checked)
output."""

import math

import pytest
import torch
from hf_reference import BLOCK_SIZE, VOCAB_SIZE, assert_greedy_match, random_prompts

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(ckpt_tied):
    engine = LLM(
        ckpt_tied.path,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=64,
        max_model_len=MAX_MODEL_LEN,
    )
    yield engine
    engine.exit()


def assert_serves_correctly(llm, path, hf_ref, seed=7):
    """A valid batch on ``llm`` gives the transformers greedy tokens, and leaves nothing behind."""
    prompts = random_prompts(seed, [3, 20, 41])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert out["prompt_token_ids"] == prompt
        assert_greedy_match(
            out["token_ids"], hf_ref.greedy(path, prompt, GREEDY.max_tokens), f"prompts[{i}]"
        )
    assert llm.is_finished()


def assert_nothing_queued(llm):
    assert not llm.core.scheduler.waiting and not llm.core.scheduler.running
    assert llm.is_finished()


# ---- LLM(...) / Config ---------------------------------------------------------------------------


def test_unknown_keyword_is_a_type_error(ckpt_tied):
    with pytest.raises(TypeError, match="'kv_block_size'") as e:
        LLM(ckpt_tied.path, kv_block_size=16)  # (vLLM's block_size is an alias)
    assert "kvcache_block_size" in str(e.value)  # lists what is accepted


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("max_num_batched_tokens", 0, ValueError),
        ("max_num_batched_tokens", 1.5, TypeError),
        ("max_num_seqs", 0, ValueError),
        ("max_num_seqs", 65536, ValueError),  # past the Triton decode grid's rows
        ("max_model_len", 0, ValueError),
        ("max_model_len", -5, ValueError),
        ("max_model_len", "4096", TypeError),
        ("gpu_memory_utilization", 0, ValueError),
        ("gpu_memory_utilization", 1.5, ValueError),
        ("gpu_memory_utilization", "0.9", TypeError),
        ("tensor_parallel_size", 0, ValueError),
        ("tensor_parallel_size", 9, ValueError),
        ("kvcache_block_size", 24, ValueError),
        ("kvcache_block_size", 0, ValueError),
        ("num_kvcache_blocks", 0, ValueError),
        ("num_kvcache_blocks", -2, ValueError),
        ("enforce_eager", "yes", TypeError),
        ("disable_custom_all_reduce", 1, TypeError),
        ("device", "tpu", ValueError),
        ("dtype", "int8", ValueError),
        ("attention_backend", "foo", ValueError),
    ],
)
def test_invalid_config_value(ckpt_tied, field, value, exc):
    with pytest.raises(exc) as e:
        LLM(ckpt_tied.path, **{field: value})
    message = str(e.value)
    assert field in message and str(value) in message, message


@pytest.mark.parametrize(
    "field, value", [("device", "tpu"), ("dtype", "int8"), ("attention_backend", "foo")]
)
def test_invalid_choice_lists_accepted_values(ckpt_tied, field, value):
    with pytest.raises(ValueError) as e:
        Config(ckpt_tied.path, **{field: value})
    assert "'auto'" in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("backend", ["flash-attn", "triton"])
def test_gpu_attention_backend_on_cpu(ckpt_tied, backend):
    with pytest.raises(ValueError) as e:
        LLM(ckpt_tied.path, attention_backend=backend, num_kvcache_blocks=4)
    assert backend in str(e.value) and "torch" in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cuda_device_on_cpu(ckpt_tied):
    with pytest.raises(ValueError, match="cuda"):
        LLM(ckpt_tied.path, device="cuda", num_kvcache_blocks=4)


def test_missing_model_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError) as e:
        LLM(missing)
    assert missing in str(e.value)


def test_max_model_len_capped_by_model(ckpt_tied):
    config = Config(ckpt_tied.path, max_model_len=100_000)
    assert config.max_model_len == 512  # the checkpoint's max_position_embeddings


# ---- SamplingParams ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, field",
    [
        (dict(temperature=-0.5), ValueError, "temperature"),
        (dict(temperature=math.nan), ValueError, "temperature"),
        (dict(temperature=math.inf), ValueError, "temperature"),
        (dict(temperature="0.7"), TypeError, "temperature"),
        (dict(max_tokens=0), ValueError, "max_tokens"),
        (dict(max_tokens=-3), ValueError, "max_tokens"),
        (dict(max_tokens=2.0), TypeError, "max_tokens"),
        (dict(max_tokens=True), TypeError, "max_tokens"),
        (dict(ignore_eos="no"), TypeError, "ignore_eos"),
    ],
)
def test_invalid_sampling_params(kwargs, exc, field):
    with pytest.raises(exc) as e:
        SamplingParams(**kwargs)
    message = str(e.value)
    assert field in message and str(kwargs[field]) in message, message


def test_unknown_sampling_param():
    with pytest.raises(TypeError, match="top_q"):
        SamplingParams(top_q=0.5)


def test_valid_sampling_params():
    assert SamplingParams(temperature=0).temperature == 0.0
    assert SamplingParams(temperature=1).temperature == 1.0
    params = SamplingParams()
    assert (params.temperature, params.max_tokens, params.ignore_eos) == (1.0, 64, False)


# ---- generate(): every prompt checked before any is queued ---------------------------------------

GOOD = random_prompts(3, [5, 17, 30, 9])


def bad_batches():
    """(prompts, sampling_params, exception, bad index, words the message must contain)."""
    return [
        pytest.param(
            [GOOD[0], GOOD[1], []], GREEDY, ValueError, 2, ["empty"], id="empty-token-list"
        ),
        pytest.param([GOOD[0], ""], GREEDY, ValueError, 1, ["empty"], id="empty-string"),
        pytest.param(
            [GOOD[0], [1] * MAX_MODEL_LEN, GOOD[1]],
            GREEDY,
            ValueError,
            1,
            [str(MAX_MODEL_LEN)],
            id="too-long",
        ),
        pytest.param(
            [GOOD[0], GOOD[1], GOOD[2], [5] * (MAX_MODEL_LEN + 7)],
            GREEDY,
            ValueError,
            3,
            ["max_model_len"],
            id="longer-than-max-model-len",
        ),
        pytest.param([[3, -1, 4], GOOD[0]], GREEDY, ValueError, 0, ["-1"], id="negative-token"),
        pytest.param(
            [GOOD[0], GOOD[1], GOOD[2], [7, VOCAB_SIZE]],
            GREEDY,
            ValueError,
            3,
            [str(VOCAB_SIZE)],
            id="token-too-large",
        ),
        pytest.param([GOOD[0], [1, 2.0, 3]], GREEDY, TypeError, 1, ["2.0"], id="float-token"),
        pytest.param([GOOD[0], [1, "7"]], GREEDY, TypeError, 1, ["'7'"], id="str-token"),
        pytest.param(
            [GOOD[0], GOOD[1], [True, 2]], GREEDY, TypeError, 2, ["True"], id="bool-token"
        ),
        # the bundled tokenizer knows ~150k tokens; this tiny model only 512
        pytest.param(
            [GOOD[0], "Hello, Nano-vLLM. Zebra"], GREEDY, ValueError, 1, [], id="text-outside-vocab"
        ),
        pytest.param([GOOD[0], None], GREEDY, TypeError, 1, [], id="none-prompt"),
        pytest.param(
            GOOD[:2], [GREEDY, "greedy"], TypeError, 1, ["SamplingParams"], id="bad-params-entry"
        ),
    ]


@pytest.mark.parametrize("prompts, params, exc, index, words", bad_batches())
def test_generate_rejects_bad_prompt(llm, ckpt_tied, hf_ref, prompts, params, exc, index, words):
    with pytest.raises(exc) as e:
        llm.generate(prompts, params, use_tqdm=False)
    message = str(e.value)
    assert f"prompts[{index}]" in message, message
    for word in words:
        assert word in message, message
    assert_nothing_queued(llm)
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)


def test_sampling_params_list_of_wrong_length(llm, ckpt_tied, hf_ref):
    with pytest.raises(ValueError) as e:
        llm.generate(GOOD[:3], [GREEDY, GREEDY], use_tqdm=False)
    assert "2" in str(e.value) and "3" in str(e.value)
    assert_nothing_queued(llm)
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)


def test_request_larger_than_kv_cache(ckpt_tied, hf_ref):
    with LLM(
        ckpt_tied.path,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=4,
        max_model_len=MAX_MODEL_LEN,
    ) as llm:
        # 60 prompt tokens fit in 4 blocks of 16, but 60 + 10 completion tokens need 5
        batch = [GOOD[0], random_prompts(4, [60])[0]]
        with pytest.raises(ValueError) as e:
            llm.generate(batch, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
        message = str(e.value)
        assert (
            "prompts[1]" in message and "cache" in message and "5" in message and "4" in message
        ), message
        assert_nothing_queued(llm)
        # the same prompt with a completion that fits is served (4 blocks = 64 tokens)
        outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        for i, (out, prompt) in enumerate(zip(outputs, batch)):
            assert_greedy_match(
                out["token_ids"], hf_ref.greedy(ckpt_tied.path, prompt, 4), f"prompts[{i}]"
            )


def run_to_completion(llm) -> dict[int, list[int]]:
    finished = {}
    for _ in range(1000):
        if llm.is_finished():
            return finished
        outputs, _ = llm.step()
        finished.update(outputs)
    raise AssertionError("the engine did not finish")


def test_add_request_survives_failed_generate(llm, ckpt_tied, hf_ref):
    first, second = random_prompts(11, [23, 8])
    first_id = llm.add_request(first, GREEDY)
    second_id = llm.add_request(second, SamplingParams(temperature=0, max_tokens=9))
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate([GOOD[0], []], GREEDY, use_tqdm=False)
    assert [seq.seq_id for seq in llm.core.scheduler.waiting] == [first_id, second_id]
    finished = run_to_completion(llm)
    assert set(finished) == {first_id, second_id}
    assert_greedy_match(
        finished[first_id], hf_ref.greedy(ckpt_tied.path, first, 6), "first request"
    )
    assert_greedy_match(
        finished[second_id], hf_ref.greedy(ckpt_tied.path, second, 9), "second request"
    )
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)


def test_add_request_finished_during_generate_is_reported_by_step(llm, ckpt_tied, hf_ref):
    queued = random_prompts(12, [14])[0]
    queued_id = llm.add_request(queued, SamplingParams(temperature=0, max_tokens=30))
    prompts = random_prompts(13, [6, 25])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)  # returns only its own requests
    assert [o["prompt_token_ids"] for o in outputs] == prompts
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert_greedy_match(
            out["token_ids"], hf_ref.greedy(ckpt_tied.path, prompt, 6), f"prompts[{i}]"
        )
    finished = run_to_completion(llm)
    assert list(finished) == [queued_id]
    assert_greedy_match(
        finished[queued_id], hf_ref.greedy(ckpt_tied.path, queued, 30), "queued request"
    )


def test_with_statement_and_idempotent_exit(ckpt_tied, hf_ref):
    with LLM(
        ckpt_tied.path,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=16,
        max_model_len=MAX_MODEL_LEN,
    ) as llm:
        assert isinstance(llm, LLM)
        assert_serves_correctly(llm, ckpt_tied.path, hf_ref, seed=21)
    llm.exit()  # already exited by the with-statement: a no-op
    llm.exit()

    other = LLM(
        ckpt_tied.path,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=16,
        max_model_len=MAX_MODEL_LEN,
    )
    other.exit()
    other.exit()


def test_with_statement_exits_on_error(ckpt_tied):
    with pytest.raises(RuntimeError, match="inside"):
        with LLM(ckpt_tied.path, kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=16) as llm:
            raise RuntimeError("raised inside the with-block")
    llm.exit()  # the with-statement already exited: a no-op
