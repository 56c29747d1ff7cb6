"""LoRA on a CUDA GPU (skipped without one): the Triton kernels inside the engine, eager and in
CUDA graphs, against the torch path on the CPU (float32: the same greedy tokens), for a batch
mixing the base model and three adapters, with prefix-cache hits and an adapter replaced."""

import random

import pytest
from transformers import AutoConfig

from nanovllm import LLM, SamplingParams
from nanovllm.lora.random_adapter import random_adapter
from nanovllm.lora.request import LoRARequest
from nanovllm.utils.checkpoint import make_random_checkpoint

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=4096, num_hidden_layers=3, hidden_size=512, intermediate_size=768)
SHAPE |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128, bos_token_id=0)
SHAPE |= dict(eos_token_id=5000, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch

    path = make_random_checkpoint(
        str(tmp_path_factory.mktemp("lora-gpu")), "tiny", torch.float32, std=0.3, **SHAPE
    )
    config = AutoConfig.from_pretrained(path)
    loras = []
    for i, rank in enumerate((16, 8, 4)):
        tensors, peft = random_adapter(config, rank=rank, seed=i, std=0.1)
        loras.append(LoRARequest(f"a{i}", i + 1, lora_tensors=tensors, peft_config=peft))
    rng = random.Random(0)
    shared = [rng.randrange(4096) for _ in range(300)]
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in (1, 9, 70, 257)]
    prompts += [shared, shared[:280] + [7, 8]]
    rows = [(p, lora) for p in prompts for lora in [None, *loras]]
    return path, rows, loras


def run(path, rows, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(enable_lora=True, max_loras=4, max_lora_rank=16, dtype="float32") | kwargs
    with LLM(path, max_model_len=1024, kvcache_block_size=256, **kwargs) as llm:
        prompts, loras = [p for p, _ in rows], [q for _, q in rows]
        first = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        again = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
        assert any(o.num_cached_tokens for o in again)
        return [o.outputs[0].token_ids for o in first]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_gpu_adapters_match_the_cpu_torch_path(setup, enforce_eager):
    path, rows, _ = setup
    cpu = run(path, rows, device="cpu", enforce_eager=True, num_kvcache_blocks=64)
    gpu = run(path, rows, enforce_eager=enforce_eager)
    assert gpu == cpu
    by_adapter = {}
    for (p, lora), tokens in zip(rows, gpu):
        by_adapter.setdefault(tuple(p), set()).add(tuple(tokens))
    assert all(len(v) == 4 for v in by_adapter.values())  # every adapter changes the tokens


def test_gpu_sleep_keeps_the_weights_and_adapters_in_one_buffer(setup):
    """Level 1 moves each target layer's one buffer (weight and adapters' A) to the host and back:
    after waking, the weight is again a view of it and the tokens are the same."""
    path, rows, _ = setup
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(enable_lora=True, max_loras=4, max_lora_rank=16, dtype="float32")
    with LLM(path, max_model_len=1024, enable_sleep_mode=True, **kwargs) as llm:
        prompts, loras = [p for p, _ in rows], [q for _, q in rows]
        before = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        base_before = llm.generate(prompts, params, use_tqdm=False)
        i = next(i for i, q in enumerate(loras) if q is not None)  # a LoRA step last
        llm.generate([prompts[i] * 2], params, use_tqdm=False, lora_request=[loras[i]])
        llm.sleep(1)
        llm.wake_up()
        layers = llm.core.executor.runner.lora_layers.values()
        assert all(m.weight.data_ptr() == m.lora_ext.data_ptr() for m in layers)
        after = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        # the base graphs, captured after a LoRA step, must not replay its kernel with the
        # table the last LoRA step left
        base_after = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
        tokens = [[o.outputs[0].token_ids for o in out] for out in (base_before, base_after)]
        assert tokens[0] == tokens[1]
