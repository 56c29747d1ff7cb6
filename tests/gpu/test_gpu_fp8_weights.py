"""FP8 weights on a CUDA GPU of compute capability 8.9+ (skipped without one): the torch W8A8 path
on the device equals the CPU's, and whole FP8 engines in float32 (dense with CUDA graphs, Qwen3-MoE
eager) give the CPU engine's greedy tokens; ``quantization="fp8"`` on a bf16 checkpoint runs in
bf16 with CUDA graphs and gives the tokens of the FP8 checkpoint written from it."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.quantization.fp8 import fp8_linear, quantize_activation_groups, quantize_weight_blocks
from nanovllm.utils.checkpoint import make_random_checkpoint

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             num_hidden_layers=3, vocab_size=4096, tie_word_embeddings=False)
MOE = dict(SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
PROMPTS = [[(7 * i + 3 * n) % 4096 for i in range(n)] for n in (300, 40, 9)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=0)
ENGINE = dict(max_model_len=1024, max_num_seqs=8, kvcache_block_size=256, num_kvcache_blocks=16)


@pytest.fixture(autouse=True)
def fp8_capable():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 weights need compute capability 8.9+")


def test_gpu_quantization_equals_cpu():
    """The same e4m3 bytes and float32 scales on both devices (a scale one ulp off moves values to
    the next e4m3 step): weights of many magnitudes, and activations."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 1000, generator=g) * torch.logspace(-4, 1, 1000)
    for quantize in (quantize_weight_blocks, quantize_activation_groups):
        (q, scale), (gq, gscale) = quantize(w), quantize(w.cuda())
        assert torch.equal(gscale.cpu(), scale)
        assert torch.equal(gq.cpu().view(torch.uint8), q.view(torch.uint8))


def test_gpu_fp8_linear_equals_cpu():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 640, generator=g)
    wq, ws = quantize_weight_blocks(torch.randn(300, 640, generator=g) * 0.05)
    expected = fp8_linear(x, wq, ws)
    got = fp8_linear(x.cuda(), wq.cuda(), ws.cuda()).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def run(path: str, **kwargs):
    with LLM(path, **(ENGINE | kwargs)) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o["token_ids"] for o in outputs]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_gpu_fp8_engine_equals_cpu(tmp_path, family):
    shape, config = ("tiny", SHAPE) if family == "qwen3" else ("qwen3-30b-a3b", MOE)
    path = make_random_checkpoint(str(tmp_path / family), shape, dtype=torch.bfloat16, seed=1, std=0.1,
                                  quantization="fp8", **config)
    cpu = run(path, device="cpu", kvcache_block_size=16, num_kvcache_blocks=256)
    assert run(path, dtype="float32") == cpu  # CUDA graphs for the dense model; Qwen3-MoE FP8 runs eagerly


def test_gpu_quantize_at_load_bf16(tmp_path):
    bf16 = make_random_checkpoint(str(tmp_path / "bf16"), "tiny", dtype=torch.bfloat16, seed=2, std=0.1, **SHAPE)
    fp8 = make_random_checkpoint(str(tmp_path / "fp8"), "tiny", dtype=torch.bfloat16, seed=2, std=0.1,
                                 quantization="fp8", **SHAPE)
    assert run(bf16, quantization="fp8") == run(fp8)
