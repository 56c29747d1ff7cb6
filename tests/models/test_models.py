"""The model registry and the architectures beyond Qwen3 dense: greedy generation must match Hugging
Face transformers token for token (CPU, float32) for Qwen2 (q/k/v biases), Llama 3 (the ``llama3``
RoPE scaling, tied and untied heads) and Qwen3-MoE (several experts per token, ``norm_topk_prob``
true and false, a dense layer in ``mlp_only_layers``), through chunked prefill, preemption and
prefix-cache hits; the MoE also over two CPU ranks. Plus the expert loading and
``load_format="dummy"``."""

import json
import os

import pytest
import torch
from hf_reference import BLOCK_SIZE, VOCAB_SIZE, assert_greedy_match, mixed_prompts
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import make_random_checkpoint

MAX_TOKENS = 12
TINY = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=3,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=VOCAB_SIZE + 1,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)  # wavelengths of 16-64 positions are blended
VARIANTS = {
    "qwen2": dict(shape="qwen2.5-0.5b", tie_word_embeddings=True),
    "llama_tied": dict(shape="llama3.2-1b", tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE),
    "llama_untied": dict(
        shape="llama3.2-1b", tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE, rope_theta=10000.0
    ),
    "moe_norm_topk": dict(
        shape="qwen3-30b-a3b",
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
    "moe_plain_topk": dict(
        shape="qwen3-30b-a3b",
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[0],
        tie_word_embeddings=True,
    ),
}


def build(root, name: str) -> str:
    variant = dict(VARIANTS[name])
    path = str(root / name)
    return make_random_checkpoint(
        path, variant.pop("shape"), dtype=torch.float32, seed=3, std=0.3, **(TINY | variant)
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: build(root, name) for name in VARIANTS}


def make_llm(path: str, **kwargs) -> LLM:
    # the CPU even where a GPU exists: float32 there is exact enough for TIE_GAP (the GPU's fused
    # MoE kernel is checked against the torch reference in tests/layers/test_fused_moe.py)
    kwargs = (
        dict(device="cpu", kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=256, max_model_len=256)
        | kwargs
    )
    return LLM(path, **kwargs)


def check(outputs, prompts, path, hf_ref, what):
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert_greedy_match(
            out["token_ids"], hf_ref.greedy(path, prompt, MAX_TOKENS), f"{what}: prompt {i}"
        )


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_transformers(name, checkpoints, hf_ref):
    """One engine with a 64-token prefill budget and 14 blocks (chunked prefill and preemption),
    then a roomy one generating twice (the second time from the prefix cache)."""
    path = checkpoints[name]
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with make_llm(path, max_num_batched_tokens=64, num_kvcache_blocks=14) as llm:
        preempted = []
        preempt = llm.core.scheduler.preempt
        llm.core.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
        tight = llm.generate(prompts, params, use_tqdm=False)
    assert preempted, "14 blocks should force preemption"
    check(tight, prompts, path, hf_ref, f"{name}, chunked and preempted")
    with make_llm(path) as llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)
    assert [o["num_cached_tokens"] for o in again] == [
        BLOCK_SIZE * ((len(p) - 1) // BLOCK_SIZE) for p in prompts
    ]
    check(first, prompts, path, hf_ref, name)
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in first]


def test_transformers_sees_the_variants(checkpoints, hf_ref):
    """The reference runs what the parity tests claim: biases, the scaled RoPE, experts, dense
    layers."""
    qwen2 = hf_ref.model(checkpoints["qwen2"]).model.layers[0].self_attn
    assert qwen2.q_proj.bias is not None and qwen2.o_proj.bias is None
    llama = hf_ref.model(checkpoints["llama_tied"])
    assert llama.config.rope_parameters["rope_type"] == "llama3"
    moe = hf_ref.model(checkpoints["moe_norm_topk"]).model.layers
    assert (
        hasattr(moe[0].mlp, "experts")
        and not hasattr(moe[1].mlp, "experts")
        and hasattr(moe[2].mlp, "experts")
    )
    assert moe[0].mlp.gate.top_k == 3 and moe[0].mlp.gate.norm_topk_prob


def test_llama3_rope_scaling_changes_the_reference(checkpoints, hf_ref, tmp_path):
    """The Llama parity would notice unscaled RoPE: without the scaling the reference differs."""
    path = checkpoints["llama_tied"]
    plain = str(tmp_path / "plain")
    os.makedirs(plain)
    for name in os.listdir(path):
        os.symlink(os.path.join(path, name), os.path.join(plain, name))
    os.remove(os.path.join(plain, "config.json"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.pop("rope_scaling")
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(config, f)
    prompts = mixed_prompts()
    assert any(
        hf_ref.greedy(plain, prompts[i], MAX_TOKENS).tokens
        != hf_ref.greedy(path, prompts[i], MAX_TOKENS).tokens
        for i in (8, 9, 10)
    )


def test_moe_tp2_matches_tp1_and_transformers(checkpoints, hf_ref):
    """Every expert's intermediate dimension split over two CPU ranks (gloo), chunked prefill."""
    path = checkpoints["moe_norm_topk"]
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    results = {}
    for tp in (1, 2):
        with make_llm(path, tensor_parallel_size=tp, max_num_batched_tokens=64) as llm:
            results[tp] = llm.generate(prompts, params, use_tqdm=False)
        check(results[tp], prompts, path, hf_ref, f"tp={tp}")
    assert [o["token_ids"] for o in results[2]] == [o["token_ids"] for o in results[1]]


def test_unsupported_architecture_is_refused_before_loading(checkpoints, tmp_path):
    path = str(tmp_path / "mistral")
    os.makedirs(path)
    with open(os.path.join(checkpoints["qwen2"], "config.json")) as f:
        config = json.load(f)
    config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)  # and no weights: the architecture must be the first complaint
    with pytest.raises(
        ValueError,
        match=r"'MistralForCausalLM' is not supported; supported: Qwen3ForCausalLM, "
        r"Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM, Qwen3MoeForCausalLM, "
        r"Qwen2ForCausalLM, LlamaForCausalLM",
    ):
        LLM(path)


def rewrite_weights(src: str, dst: str, change) -> str:
    """A copy of checkpoint ``src`` whose tensors went through ``change(dict)``."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    change(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def expert_params(llm) -> dict[str, torch.Tensor]:
    model = llm.core.executor.runner.model
    return {k: v.detach().clone() for k, v in model.named_parameters() if ".experts." in k}


def test_expert_weights_load_per_expert_or_fused(checkpoints, tmp_path):
    """Per-expert tensors and the fused [experts, 2 * inter, hidden] / [experts, hidden, inter]
    layout load to the same parameters; a missing expert tensor is an error naming it."""
    path = checkpoints["moe_plain_topk"]

    def fuse(t):
        for layer in (1, 2):
            p = f"model.layers.{layer}.mlp.experts."
            gate = [t.pop(f"{p}{e}.gate_proj.weight") for e in range(6)]
            up = [t.pop(f"{p}{e}.up_proj.weight") for e in range(6)]
            t[p + "gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(gate, up)])
            t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(6)])

    fused = rewrite_weights(path, str(tmp_path / "fused"), fuse)
    with make_llm(path) as a, make_llm(fused) as b:
        want, got = expert_params(a), expert_params(b)
    assert want.keys() == got.keys() and len(want) == 4
    assert all(torch.equal(want[k], got[k]) for k in want)
    gate = want["model.layers.1.mlp.experts.gate_up_proj"]
    ref = load_file(os.path.join(path, "model.safetensors"))
    assert torch.equal(gate[4, 48:], ref["model.layers.1.mlp.experts.4.up_proj.weight"])

    missing = rewrite_weights(
        path,
        str(tmp_path / "missing"),
        lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"),
    )
    with pytest.raises(
        ValueError, match=r"lacks weights for: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"
    ):
        make_llm(missing)


def test_dummy_load_format(checkpoints, tmp_path):
    """No weight files: norms 1, biases 0, the rest N(0, 0.02) from a fixed seed (so two engines
    agree), for benchmarks of shapes too large for the disk."""
    path = make_random_checkpoint(str(tmp_path / "dummy"), "qwen2.5-0.5b", weights=False, **TINY)
    assert not any(name.endswith(".safetensors") for name in os.listdir(path))
    prompts = mixed_prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    runs = []
    for _ in range(2):
        with make_llm(path, load_format="dummy") as llm:
            params_ = dict(llm.core.executor.runner.model.named_parameters())
            runs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
    assert torch.equal(params_["model.norm.weight"], torch.ones(64))
    assert not params_["model.layers.0.self_attn.qkv_proj.bias"].any()
    std = params_["model.layers.0.mlp.gate_up_proj.weight"].std().item()
    assert 0.018 < std < 0.022, std
    with pytest.raises(ValueError, match="load_format"):
        make_llm(path, load_format="safetensors")
