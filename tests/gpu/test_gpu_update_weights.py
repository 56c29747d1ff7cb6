"""``update_weights`` on CUDA GPUs (skipped without one): with CUDA graphs captured, an engine
updated with a second checkpoint's tensors gives the tokens of an engine loaded from it, every
parameter keeps its storage (so the graphs read the new values), and the prefix cache filled
before serves nothing; on one GPU (tensors given on the CPU in float32) and on two over NCCL
(tensors given on the GPU in bfloat16), for Qwen3 and Qwen3-MoE (the fused Triton MoE kernel)."""

import os

import pytest
import torch
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import make_random_checkpoint

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)

SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    num_hidden_layers=3,
    vocab_size=4096,
)
FAMILIES = {
    "qwen3": dict(shape="tiny"),
    "qwen3_moe": dict(
        shape="qwen3-30b-a3b",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        tie_word_embeddings=False,
    ),
}
PROMPTS = [[(7 * i + 3 * n) % 4096 for i in range(n)] for n in (300, 40, 520, 9)]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
ENGINE = dict(max_model_len=2048, max_num_seqs=16, kvcache_block_size=256)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("gpu-update")
    paths = {}
    for family, variant in FAMILIES.items():
        variant = dict(variant)
        shape = variant.pop("shape")
        paths[family] = tuple(
            make_random_checkpoint(
                str(root / f"{family}-{seed}"),
                shape,
                dtype=torch.bfloat16,
                seed=seed,
                std=0.1,
                **(SHAPE | variant),
            )
            for seed in (1, 2)
        )
    return paths


def generate(llm: LLM) -> tuple[list[list[int]], list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o["token_ids"] for o in outputs], [o["num_cached_tokens"] for o in outputs]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_update_in_place_under_cuda_graphs(checkpoints, family, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    a, b = checkpoints[family]
    with LLM(b, tensor_parallel_size=tp, **ENGINE) as ref:
        want, _ = generate(ref)
    weights = load_file(os.path.join(b, "model.safetensors"))
    if tp == 1:
        weights = {name: t.float() for name, t in weights.items()}  # another dtype, on the CPU
    else:
        weights = {name: t.to("cuda:0") for name, t in weights.items()}  # on rank 0's GPU
    with LLM(a, tensor_parallel_size=tp, **ENGINE) as llm:
        runner = llm.core.executor.runner
        assert runner.graphs is not None, "the decode steps should run as CUDA graphs"
        before, _ = generate(llm)
        # the prefix cache now holds the prompts' full blocks (in bfloat16 a hit may move a
        # near-tie: the tokens themselves are compared where no prompt hits the cache)
        assert generate(llm)[1] == [256, 0, 512, 0]
        storage = {name: p.data_ptr() for name, p in runner.model.named_parameters()}
        llm.update_weights(weights.items())
        assert generate(llm) == (want, [0] * len(PROMPTS))
        assert {name: p.data_ptr() for name, p in runner.model.named_parameters()} == storage
        assert before != want
