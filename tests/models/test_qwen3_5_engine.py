"""Qwen3.5's hybrid model through the engine on the CPU (float32) against transformers' own
Qwen3_5ForCausalLM, greedy: token for token, through chunked prefill (chunks that split the
convolution window), preemption (the states recomputed), n > 1 and two tensor-parallel ranks,
with log-probabilities within 1e-4; prefix caching is off."""

import os
import random
import shutil

import pytest
import torch
from hf_reference import assert_greedy_match, greedy_logprobs

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import TOKENIZER_DIR

LAYERS = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=len(LAYERS),
    layer_types=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=513,
)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    path = str(tmp_path_factory.mktemp("qwen3_5"))
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log") or name.endswith("dt_bias"):
                continue
            param.normal_(0.0, 0.3 if param.dim() > 1 else 0.1)
    return save_with_tokenizer(model, path), model


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(512) for _ in range(n)] for n in (1, 3, 12, 17, 28, 60, 70, 130)]


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n, logprobs=0)


ENGINES = dict(
    plain=dict(),
    chunked=dict(max_num_batched_tokens=7),  # chunks of 7 tokens split the 4-wide conv window
    preempted=dict(num_kvcache_blocks=12, max_num_batched_tokens=64),  # preemption
    tp2=dict(tensor_parallel_size=2),  # heads of both layer kinds split over two ranks
)


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_greedy_matches_transformers(qwen35, engine):
    check_engine(*qwen35, engine)


def save_with_tokenizer(model, path: str) -> str:
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), os.path.join(path, name))
    return path


def check_engine(path: str, model, engine: dict) -> None:
    """The engine's greedy tokens and log-probabilities (``engine``: LLM keywords) equal the
    transformers ``model``'s; n=2 repeats them; no prefix cache; preemption when asked for."""
    kwargs = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=128, max_model_len=256)
    with LLM(path, **(kwargs | engine)) as llm:
        outs = llm.generate(prompts(), greedy(), use_tqdm=False)
        again = llm.generate(prompts()[5:], greedy(2), use_tqdm=False)
        stats = llm.get_stats()
    for i, (out, prompt) in enumerate(zip(outs, prompts())):
        ref, logprobs = greedy_logprobs(model, prompt, MAX_TOKENS)
        got = out.outputs[0]
        assert_greedy_match(got.token_ids, ref, f"prompt {i}")
        if got.token_ids == ref.tokens:
            values = [entry[t].logprob for entry, t in zip(got.logprobs, got.token_ids)]
            assert values == pytest.approx(logprobs, abs=1e-4), f"prompt {i}"
    for out, first in zip(again, outs[5:]):
        assert [c.token_ids for c in out.outputs] == [first.outputs[0].token_ids] * 2
        assert out.num_cached_tokens == 0  # no prefix cache for hybrid models
    assert stats["prefix_cache_hits"] == 0 and stats["prefix_caching"] is False
    if engine.get("max_num_batched_tokens") == 64:
        assert stats["num_preemptions"] > 0
