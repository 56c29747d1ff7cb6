"""Sleep mode on CUDA GPUs (skipped without one): with CUDA graphs captured, ``sleep(1)`` and
``sleep(2)`` give back the device memory of the KV cache, the graphs and the weights (measured by
torch on rank 0's GPU, and printed), and after ``wake_up`` (level 2: and ``update_weights`` with the
checkpoint's tensors) the outputs are the same token for token, the graphs captured again; on one
GPU and on two over NCCL."""

import os

import pytest
import torch
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import make_random_checkpoint

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)

SHAPE = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    num_hidden_layers=8,
    vocab_size=32768,
)
PROMPTS = [[(7 * i + 3 * n) % 32768 for i in range(n)] for n in (300, 40, 520, 9)]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
ENGINE = dict(
    max_model_len=2048,
    max_num_seqs=16,
    kvcache_block_size=256,
    gpu_memory_utilization=0.5,
    enable_sleep_mode=True,
)
MIB = 2**20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_random_checkpoint(
        str(tmp_path_factory.mktemp("gpu-sleep")),
        "tiny",
        dtype=torch.bfloat16,
        seed=1,
        std=0.05,
        tie_word_embeddings=False,
        **SHAPE,
    )


def generate(llm: LLM) -> tuple[list[list[int]], list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o["token_ids"] for o in outputs], [o["num_cached_tokens"] for o in outputs]


def memory() -> dict[str, int]:
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "free": free,
    }


def show(what: str, m: dict[str, int]) -> None:
    print(
        f"{what:>22}: allocated {m['allocated'] / MIB:9.1f} MiB, "
        f"reserved {m['reserved'] / MIB:9.1f} MiB, device free {m['free'] / MIB:9.1f} MiB"
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_sleep_frees_the_device_and_wake_up_restores_the_outputs(checkpoint, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    with LLM(checkpoint, tensor_parallel_size=tp, **ENGINE) as llm:
        runner = llm.core.executor.runner
        assert runner.graphs is not None, "the decode steps should run as CUDA graphs"
        want, _ = generate(llm)
        assert generate(llm)[1] == [256, 0, 512, 0]
        cache_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        awake = memory()
        print(
            f"\ntp={tp}: KV cache {cache_bytes / MIB:.1f} MiB, "
            f"weights {weight_bytes / MIB:.1f} MiB on rank 0"
        )
        show("awake", awake)
        for level in (1, 2):
            llm.sleep(level)
            asleep = memory()
            show(f"asleep (level {level})", asleep)
            assert asleep["allocated"] <= awake["allocated"] - cache_bytes - weight_bytes
            assert asleep["reserved"] <= awake["reserved"] - cache_bytes - weight_bytes
            assert asleep["free"] >= awake["free"] + cache_bytes + weight_bytes
            llm.wake_up()
            show(f"awake (level {level})", memory())
            assert runner.graphs is not None
            if level == 2:
                llm.update_weights(weights.items())
            assert generate(llm) == (want, [0] * len(PROMPTS))
            assert generate(llm)[1] == [256, 0, 512, 0]
