"""bench_floor.py's byte counts, against sums written out independently of its loops."""

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [
    str(ROOT),
    str(ROOT / "benchmarks"),
]  # bench.py at the repo root, bench_floor.py in benchmarks/

from bench_floor import state_bytes, step_bytes, weight_bytes_by_kind, workload_floor  # noqa: E402

from bench import workload  # noqa: E402
from nanovllm.utils.checkpoint import model_config, weight_bytes  # noqa: E402


def test_dense_weights_exclude_only_an_untied_embedding():
    tied, untied = model_config("qwen3-0.6b"), model_config("qwen3-4b")
    assert weight_bytes_by_kind(tied) == (
        0,
        weight_bytes(tied),
    )  # the LM head reads the tied matrix
    assert weight_bytes_by_kind(untied) == (
        0,
        weight_bytes(untied) - untied["vocab_size"] * untied["hidden_size"] * 2,
    )


def test_moe_experts_and_routing():
    config = model_config("qwen3-30b-a3b")
    experts, dense = weight_bytes_by_kind(config)
    expert_layer = 128 * 3 * 768 * 2048 * 2  # 128 experts of gate, up and down in each of 48 layers
    assert experts == 48 * expert_layer
    assert dense + experts == weight_bytes(config) - 151936 * 2048 * 2
    # one token touches exactly its 8 experts; KV: 48 layers, 4 KV heads
    weights, kv, state = step_bytes(config, [100], 512)
    assert state == 0
    assert weights == pytest.approx(dense + 48 * expert_layer * 8 / 128)
    assert kv == 100 * 48 * 4 * 512
    weights, _, _ = step_bytes(config, [1] * 256, 512)  # at 256 tokens every expert is expected
    assert weights == pytest.approx(dense + 48 * expert_layer * (1 - (120 / 128) ** 256))


def test_workload_kv_is_the_closed_form_sum():
    config = model_config("qwen3-0.6b")
    prompts, params = workload(256)
    per_token = 28 * 8 * 4 * 128  # layers * KV heads * (K and V, bf16, head_dim 128)
    # request i decodes max_tokens - 1 steps over contexts len(prompt) + 1 ...
    # len(prompt) + max_tokens - 1
    expected = sum(
        per_token * (len(p) * (sp.max_tokens - 1) + sp.max_tokens * (sp.max_tokens - 1) // 2)
        for p, sp in zip(prompts, params)
    )
    weights, kv, state, steps = workload_floor(config, 256, 4 * 128)
    assert state == 0
    assert steps == max(sp.max_tokens for sp in params) - 1
    assert kv == expected
    assert weights == steps * weight_bytes(config)
    assert math.isclose(kv / 1e12, 13.85, abs_tol=0.01)  # the figure BENCHMARKS.md quotes


def test_fp8_weights_count_one_byte_plus_block_scales():
    config = model_config("qwen3-8b")
    _, dense = weight_bytes_by_kind(config)
    _, fp8 = weight_bytes_by_kind(config, quantization="fp8")
    # per layer: q 4096x4096, k and v 1024x4096, o 4096x4096, gate and up 12288x4096,
    # down 4096x12288
    values = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 12288 * 4096
    blocks = 2 * 32 * 32 + 2 * 8 * 32 + 3 * 96 * 32  # 128x128 blocks of the same
    assert dense - fp8 == 36 * (
        values * 2 - (values + 4 * blocks)
    )  # embeddings, norms and LM head unchanged
    moe = model_config("qwen3-30b-a3b")
    experts, _ = weight_bytes_by_kind(moe, quantization="fp8")
    assert experts == 48 * 128 * 3 * (768 * 2048 + 4 * 6 * 16)
    assert weight_bytes(config, quantization="fp8") == weight_bytes(config) - 36 * (
        values - 4 * blocks
    )


def test_hybrid_kv_in_full_attention_layers_and_states():
    """Qwen3.5-9B's shape: KV in its 8 full-attention layers only; each of its 24 linear-attention
    layers reads and writes a float32 32 x 128 x 128 state and a 3-token bf16 window of its
    16 * 128 * 2 + 32 * 128 channels, once per sequence and step."""
    config = model_config("qwen3.5-9b")
    assert config["layer_types"].count("full_attention") == 8
    per_seq = 24 * (32 * 128 * 128 * 4 + (16 * 128 * 2 + 32 * 128) * 3 * 2)
    assert state_bytes(config) == per_seq
    _, kv, state = step_bytes(config, [100, 50], 4 * 256)
    assert kv == 150 * 8 * 4 * 4 * 256 and state == 2 * 2 * per_seq
