"""On a CUDA GPU (skipped without one): the Triton kernels over an FP8 KV cache against the torch
backend's dequantize-then-attend in float32, the quantizing store byte for byte, and whole engines
with ``kv_cache_dtype="fp8"`` on the Triton backend. (Whole float32 engines on the Triton backend,
head_dim 128 and prompts of up to 700 tokens, are checked against transformers in
``test_gpu_models.py``; float32 prefill over a cached prefix at the kernel level in
``test_attention_backends.py``.)"""

import random

import pytest
import torch
from test_attention_backends import GPU_DECODE_LENS, GPU_PREFILL
from test_fp8_kv_cache import (
    STORE_CASES,
    TRITON_STORE_CASES,
    check_decode,
    check_prefill,
    check_store,
)
from test_kv_store import rope_store_kvcache

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)

GPU_TOL = 1e-2  # bf16 queries and probabilities against float32
VOCAB = 4096


def triton_backend(num_splits=None):
    from nanovllm.layers.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", TRITON_STORE_CASES)
def test_gpu_fp8_store(case, dtype):
    result = check_store(rope_store_kvcache, **dict(STORE_CASES[case], dtype=dtype), device="cuda")
    assert result["problems"] is None, result


# every split count in bf16 and fp16; float32 (each variant a slow compile) with one pass and with
# split keys and their reduction
DECODE_GRID = [
    (block_size, num_splits, dtype)
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for num_splits in ((1, 8) if dtype == torch.float32 else (1, 2, 8, None))
    for block_size in (16, 256)
]


@pytest.mark.parametrize(
    "block_size,num_splits,dtype",
    DECODE_GRID,
    ids=[f"{b}-{n}-{str(d).removeprefix('torch.')}" for b, n, d in DECODE_GRID],
)
def test_gpu_fp8_decode(num_splits, block_size, dtype):
    result = check_decode(
        triton_backend(num_splits),
        GPU_DECODE_LENS,
        device="cuda",
        dtype=dtype,
        head_dim=128,
        block_size=block_size,
        num_heads=16,
        num_kv_heads=8,
    )
    assert result["padded_finite"], result
    assert result["rel_err"] < GPU_TOL, result


# every case in bf16; float32 once (its kernel variants take 20-40 s each to compile on an H100
# host)
PREFILL_GRID = [
    (case, block_size, heads, torch.bfloat16)
    for case in GPU_PREFILL
    for block_size in (16, 256)
    for heads in ((16, 8), (32, 4))
] + [("prefill_prefix", 16, (32, 4), torch.float32)]


@pytest.mark.parametrize(
    "case,block_size,heads,dtype",
    PREFILL_GRID,
    ids=[
        f"{c}-{b}-gqa{h[0] // h[1]}-{'fp32' if d == torch.float32 else 'bf16'}"
        for c, b, h, d in PREFILL_GRID
    ],
)
def test_gpu_fp8_prefill(case, block_size, heads, dtype):
    result = check_prefill(
        triton_backend(),
        GPU_PREFILL[case],
        device="cuda",
        dtype=dtype,
        head_dim=128,
        block_size=block_size,
        num_heads=heads[0],
        num_kv_heads=heads[1],
    )
    assert result["cache_equal"], result
    assert result["rel_err"] < GPU_TOL, result


# ---- engines -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from nanovllm.utils.checkpoint import make_random_checkpoint

    return make_random_checkpoint(
        str(tmp_path_factory.mktemp("gpu-fp8-qwen3")),
        "tiny",
        dtype=torch.bfloat16,
        seed=4,
        std=0.1,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        num_hidden_layers=3,
        vocab_size=VOCAB,
    )


def make_prompts() -> list[list[int]]:
    """Short and long prompts (several prefill tiles), and prefixes shared across 256-token
    blocks."""
    rng = random.Random(0)
    shared = [rng.randrange(VOCAB) for _ in range(600)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 9, 130, 257, 700)]
    return prompts + [shared[:300], shared[:520] + [5, 6, 7], shared]


def generate(model_dir, **kwargs) -> list[dict]:
    """Two greedy passes (the second partly from the prefix cache), with the top-2
    log-probabilities."""
    from nanovllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    # 8 prompts: 16 sequences a step need 5 decode graphs, not the 35 of 512
    with LLM(
        model_dir, max_model_len=1024, kvcache_block_size=256, max_num_seqs=16, **kwargs
    ) as llm:
        first = llm.generate(make_prompts(), params, use_tqdm=False)
        again = llm.generate(make_prompts(), params, use_tqdm=False)
    assert any(o["num_cached_tokens"] for o in again)
    return first + again


def assert_agree(expected: list[dict], got: list[dict], near_tie: float) -> None:
    """Token-for-token equality, except that a sequence may part from the reference once where the
    reference's top two log-probabilities are within ``near_tie``; the rest is then not compared."""
    for i, (e, g) in enumerate(zip(expected, got)):
        for j, (a, b) in enumerate(zip(e["token_ids"], g["token_ids"])):
            if a != b:
                top2 = sorted(e["logprobs"][j].values(), reverse=True)[:2]
                assert top2[0] - top2[1] < near_tie, (
                    f"output {i} parts at token {j} with a top-2 gap {top2[0] - top2[1]:.4f}"
                )
                break
        else:
            assert len(e["token_ids"]) == len(g["token_ids"])


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_llm_fp8_triton_matches_torch_fp8(model_dir, enforce_eager):
    reference = generate(
        model_dir, kv_cache_dtype="fp8", attention_backend="torch", enforce_eager=True
    )
    got = generate(
        model_dir, kv_cache_dtype="fp8", attention_backend="triton", enforce_eager=enforce_eager
    )
    assert_agree(reference, got, near_tie=0.2)  # bf16 logits, 1/32 to 1/16 apart at this size


def test_llm_fp8_auto_backend_is_triton(model_dir):
    from nanovllm import LLM

    with LLM(
        model_dir, kv_cache_dtype="fp8", max_model_len=256, num_kvcache_blocks=4, enforce_eager=True
    ) as llm:
        assert llm.core.executor.runner.backend.name == "triton"
        assert llm.core.executor.runner.kv_cache.dtype == torch.float8_e4m3fn
