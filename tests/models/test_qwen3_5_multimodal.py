"""A ``Qwen3_5ForConditionalGeneration`` checkpoint (text_config nested, ``model.language_model.*``
weights, a vision tower and a multi-token-prediction head) runs its language model alone: greedy
tokens and log-probabilities (1e-4, float32, CPU) equal transformers' own text-only output."""

import os

import pytest
import torch
from safetensors.torch import save_file
from test_qwen3_5_engine import CONFIG, check_engine, save_with_tokenizer

pytest.importorskip("transformers.models.qwen3_5")
# 8 rotary dims per head: mrope sections of 2 + 1 + 1 frequencies, text positions in all three
ROPE = dict(CONFIG["rope_parameters"], mrope_section=[2, 1, 1], mrope_interleaved=True)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
VISION.update(patch_size=4, num_position_embeddings=16)
TOKENS = dict(image_token_id=500, video_token_id=501, vision_start_token_id=502)
TOKENS.update(vision_end_token_id=503)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def multimodal(request, tmp_path_factory):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(CONFIG, rope_parameters=ROPE)
    config = Qwen3_5Config(
        text_config=text, vision_config=VISION, tie_word_embeddings=request.param, **TOKENS
    )
    torch.manual_seed(1)
    model = Qwen3_5ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                param.normal_(0.0, 0.3 if param.dim() > 1 else 0.1)
    path = save_with_tokenizer(model, str(tmp_path_factory.mktemp("qwen3_5_mm")))
    mtp = {"mtp.fc.weight": torch.ones(64, 128), "mtp.norm.weight": torch.ones(64)}
    save_file(mtp, os.path.join(path, "mtp.safetensors"))  # skipped like the vision tower
    return path, model


@pytest.mark.parametrize(
    "engine", [dict(), dict(max_num_batched_tokens=7)], ids=["plain", "chunked"]
)
def test_text_generation_matches_transformers(multimodal, engine):
    check_engine(*multimodal, engine)


def test_config_is_the_language_models(multimodal):
    from nanovllm.config import Config

    config = Config(multimodal[0], device="cpu")
    text = multimodal[1].config
    assert config.hf_config.architectures == ["Qwen3_5ForCausalLM"]
    assert config.hf_config.num_hidden_layers == text.text_config.num_hidden_layers
    assert config.hf_config.tie_word_embeddings == text.tie_word_embeddings
