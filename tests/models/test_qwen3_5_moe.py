"""Qwen3.5-MoE (routed experts plus a sigmoid-gated shared expert in every layer) through the
engine on the CPU (float32) against transformers' Qwen3_5MoeForCausalLM and, text only,
Qwen3_5MoeForConditionalGeneration: greedy tokens equal and log-probabilities within 1e-4, through
chunked prefill, preemption, n > 1 and two tensor-parallel ranks."""

import pytest
import torch
from test_qwen3_5_engine import CONFIG, ENGINES, check_engine, save_with_tokenizer

pytest.importorskip("transformers.models.qwen3_5_moe")
LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
LAYERS += ["full_attention"]
MOE = dict(CONFIG, num_hidden_layers=len(LAYERS), layer_types=LAYERS, head_dim=256)
MOE.update(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32)
MOE.update(shared_expert_intermediate_size=48)
del MOE["intermediate_size"]


def randomised(model, seed: int = 2):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                param.normal_(0.0, 0.3 if param.dim() > 1 else 0.1)
    return model.float().eval()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    model = randomised(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**MOE)))
    return save_with_tokenizer(model, str(tmp_path_factory.mktemp("qwen3_5_moe"))), model


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_greedy_matches_transformers(moe, engine):
    check_engine(*moe, engine)


def test_conditional_generation_text_only(tmp_path):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    tokens = dict(image_token_id=500, video_token_id=501, vision_start_token_id=502)
    config = Qwen3_5MoeConfig(text_config=MOE, vision_config=vision, **tokens)
    model = randomised(Qwen3_5MoeForConditionalGeneration(config))
    check_engine(save_with_tokenizer(model, str(tmp_path)), model, dict())
