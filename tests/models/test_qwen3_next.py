"""Qwen3-Next (Gated DeltaNet projections interleaved per key-head group, sparse layers with a
shared expert, one dense MLP layer) through the engine on the CPU (float32) against transformers'
Qwen3NextForCausalLM: greedy tokens equal and log-probabilities within 1e-4, plain, in chunks that
split the conv window and over two tensor-parallel ranks (key-head groups split)."""

import pytest
from test_qwen3_5_engine import ENGINES, check_engine, save_with_tokenizer
from test_qwen3_5_moe import MOE, randomised

pytest.importorskip("transformers.models.qwen3_next")
# layer 1 dense (mlp_only_layers); 4 value heads over 2 key heads: groups of two
NEXT = dict(MOE, mlp_only_layers=[1], intermediate_size=80, norm_topk_prob=True)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    model = randomised(Qwen3NextForCausalLM(Qwen3NextConfig(**NEXT)), seed=3)
    return save_with_tokenizer(model, str(tmp_path_factory.mktemp("qwen3_next"))), model


@pytest.mark.parametrize("name", ["plain", "chunked", "tp2"])
def test_greedy_matches_transformers(qwen3_next, name):
    check_engine(*qwen3_next, ENGINES[name])
