"""The architectures beyond Qwen3 dense on a CUDA GPU (skipped without one): Qwen2 with biases,
Llama 3 with the ``llama3`` RoPE scaling and Qwen3-MoE (the fused Triton MoE kernel), greedy,
against transformers' float32 greedy tokens on the same GPU. In float32 (Triton attention, with and
without CUDA graphs, and over two GPUs where there are two; head_dim 128 and prompts of up to 700
tokens, so the prefill tiles must fit shared memory at 4 bytes an element) a divergence must be a
float32 tie. In bf16 (Triton and flash-attn, graphs) it must be a bf16 near-tie as in
``test_gpu.py``; for the dense models only: in an MoE a bf16 rounding can swap one of the router's
top-k experts, after which the logits move by more than any rounding bound (the kernel's bf16
accuracy is checked in ``test_fused_moe.py``)."""

import pytest
import torch
from test_gpu import HAS_FLASH_ATTN, assert_agree, make_prompts

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import make_random_checkpoint

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)

MAX_TOKENS = 24
# head_dim 128 (the flash-attn build's), vocabulary 4096 (make_prompts' ids), an EOS never produced
COMMON = dict(
    vocab_size=4096,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=3,
    max_position_embeddings=2048,
    bos_token_id=0,
    eos_token_id=5000,
)
MODELS = {
    "qwen2": dict(
        shape="qwen2.5-0.5b", hidden_size=512, intermediate_size=512, tie_word_embeddings=True
    ),
    "llama3": dict(
        shape="llama3.2-1b",
        hidden_size=512,
        head_dim=128,
        intermediate_size=512,
        tie_word_embeddings=False,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
    ),
    "qwen3_moe": dict(
        shape="qwen3-30b-a3b",
        hidden_size=256,
        head_dim=128,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
}
DENSE = [name for name in MODELS if "moe" not in name]
# float32 reductions in another order: candidates closer than this share of max |logit| are a tie
FP32_TIE = 1e-4
BACKENDS = [
    "triton",
    pytest.param(
        "flash-attn",
        marks=pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn not installed"),
    ),
]


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    """(name, checkpoint folder, transformers float32 model on the GPU, its greedy tokens for
    make_prompts())."""
    from transformers import AutoModelForCausalLM

    spec = dict(MODELS[request.param])
    path = make_random_checkpoint(
        str(tmp_path_factory.mktemp(request.param)),
        spec.pop("shape"),
        dtype=torch.bfloat16,
        seed=1,
        std=0.1,
        **(COMMON | spec),
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    expected = []
    with torch.no_grad():
        for prompt in make_prompts():
            ids = list(prompt)
            for _ in range(MAX_TOKENS):
                ids.append(int(hf(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
            expected.append(ids[len(prompt) :])
    return request.param, path, hf, expected


def fp32_tie(logits: torch.Tensor) -> float:
    return FP32_TIE * logits.abs().max().item()


def generate(path, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    # a handful of prompts: 16 sequences a step need 5 decode graphs, not the 35 of 512
    with LLM(path, max_model_len=2048, max_num_seqs=16, **kwargs) as llm:
        return [o["token_ids"] for o in llm.generate(make_prompts(), params, use_tqdm=False)]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_float32_matches_transformers(model, enforce_eager):
    _, path, hf, expected = model
    got = generate(path, dtype="float32", attention_backend="triton", enforce_eager=enforce_eager)
    assert_agree(hf, make_prompts(), expected, got, tie=fp32_tie)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_graphs_match_transformers(model, backend):
    name, path, hf, expected = model
    if name not in DENSE:
        pytest.skip("bf16 can swap a routed expert (see the module docstring)")
    assert_agree(hf, make_prompts(), expected, generate(path, attention_backend=backend))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_float32_matches_transformers(model):
    _, path, hf, expected = model
    got = generate(path, dtype="float32", attention_backend="triton", tensor_parallel_size=2)
    assert_agree(hf, make_prompts(), expected, got, tie=fp32_tie)
