"""``bench.py --random`` knows Qwen3.5's published sizes: the written config.json loads through
the engine's checks, and the model built from it (on the meta device, no memory) holds exactly as
many parameters as transformers' model of that config."""

import os

import pytest
import torch

from nanovllm.config import Config
from nanovllm.models.registry import build_model
from nanovllm.utils.checkpoint import make_random_checkpoint
from nanovllm.utils.hybrid_shapes import HYBRID_SHAPES

pytest.importorskip("transformers.models.qwen3_5_moe")
# shape: (architecture, full-attention layers, Gated DeltaNet layers)
EXPECTED = {
    "qwen3.5-9b": ("Qwen3_5ForCausalLM", 8, 24),
    "qwen3.5-35b-a3b": ("Qwen3_5MoeForCausalLM", 10, 30),
}


@pytest.mark.parametrize("shape", list(HYBRID_SHAPES))
def test_random_shape_builds(shape, tmp_path):
    import transformers

    path = make_random_checkpoint(str(tmp_path), shape)
    assert not os.path.exists(os.path.join(path, "model.safetensors"))  # drawn at load
    config = Config(path, device="cpu", load_format="dummy", max_model_len=512)
    hf = config.hf_config
    arch, full, linear = EXPECTED[shape]
    assert hf.architectures == [arch]
    assert (hf.layer_types.count("full_attention"), hf.layer_types.count("linear_attention")) == (
        full,
        linear,
    )
    with torch.device("meta"):
        ours = build_model(hf)
        theirs = getattr(transformers, arch)(hf)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(ours) == count(theirs)
