"""Adapters on the other paths: Qwen3-MoE (attention adapters against PEFT; experts refused),
Qwen3.5 (its full-attention and MLP projections against PEFT; linear-attention layers have none),
the FP8 KV cache (an adapter equals its weights merged into the base model), and sleep mode
(the adapters' slots come back with the weights)."""

import pytest
import torch
from hf_reference import assert_greedy_match, greedy_logprobs
from lora_helpers import SIZES, build_base, make_llm, peft_model, prompts, save_adapter

from nanovllm import SamplingParams
from nanovllm.lora.request import LoRARequest
from nanovllm.utils.checkpoint import make_random_checkpoint

MAX_TOKENS = 6
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_moe_attention_adapter_matches_peft_and_experts_are_refused(tmp_path):
    moe = dict(SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    base = make_random_checkpoint(
        str(tmp_path / "moe"),
        "qwen3-30b-a3b",
        torch.float32,
        std=0.3,
        head_dim=32,
        eos_token_id=513,
        bos_token_id=0,
        **moe,
    )
    model = peft_model(base, 51, targets=ATTENTION)
    lora = LoRARequest("attn", 1, save_adapter(model, str(tmp_path / "attn")))
    experts = peft_model(base, 52, targets=["q_proj", "down_proj"])
    bad = LoRARequest("experts", 2, save_adapter(experts, str(tmp_path / "experts")))
    llm = make_llm(base)
    try:
        outs = llm.generate(prompts(), greedy(), False, lora)
        for i, (out, p) in enumerate(zip(outs, prompts())):
            assert_greedy_match(
                out.outputs[0].token_ids, greedy_logprobs(model, p, MAX_TOKENS)[0], f"{i}"
            )
        with pytest.raises(
            ValueError,
            match=r"layers.0.mlp.experts.lora_A.weight': module 'experts' is not supported",
        ):
            llm.generate(prompts(), greedy(), False, bad)
    finally:
        llm.exit()


def qwen3_5_base(path: str) -> str:
    """A tiny random Qwen3.5 (one linear-attention and one full-attention layer) saved by
    transformers, with the tokenizer files."""
    import shutil

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from nanovllm.utils.checkpoint import TOKENIZER_DIR

    config = dict(SIZES, head_dim=32, layer_types=["linear_attention", "full_attention"])
    config |= dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16)
    config |= dict(linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config, eos_token_id=513, bos_token_id=0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                param.normal_(0.0, 0.2 if param.dim() > 1 else 0.1)
    model.float().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{TOKENIZER_DIR}/{name}", f"{path}/{name}")
    return path


def test_qwen3_5_adapter_matches_peft(tmp_path):
    """A hybrid model: PEFT finds q/k/v/o only in the full-attention layer, the MLP projections
    in both; the engine (with its recurrent-state slots) gives PEFT's greedy tokens."""
    base = qwen3_5_base(str(tmp_path / "q35"))
    model = peft_model(base, 53)
    lora = LoRARequest("hybrid", 1, save_adapter(model, str(tmp_path / "hybrid")))
    with make_llm(base) as llm:
        outs = llm.generate(prompts(), greedy(), False, lora)
        base_outs = llm.generate(prompts(), greedy(), False)
    for i, (out, p) in enumerate(zip(outs, prompts())):
        assert_greedy_match(
            out.outputs[0].token_ids, greedy_logprobs(model, p, MAX_TOKENS)[0], f"{i}"
        )
    assert tokens(outs) != tokens(base_outs)


def test_fp8_kv_cache_adapter_equals_merged_weights(tmp_path):
    """With the FP8 KV cache, an adapter gives what its weights merged into the model give."""
    base = build_base(str(tmp_path / "base"), "qwen3", seed=7)
    model = peft_model(base, 61)
    lora = LoRARequest("a", 1, save_adapter(model, str(tmp_path / "a")))
    merged = str(tmp_path / "merged")
    model.merge_and_unload().save_pretrained(merged)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = tmp_path / "base" / name
        if src.exists():
            (tmp_path / "merged" / name).write_bytes(src.read_bytes())
    fp8 = dict(kv_cache_dtype="fp8")
    with make_llm(base, **fp8) as llm:
        got = tokens(llm.generate(prompts(), greedy(), False, lora))
    with make_llm(merged, enable_lora=False, **fp8) as llm:
        assert got == tokens(llm.generate(prompts(), greedy(), False))


def test_sleep_and_wake_up_keep_the_adapters(tmp_path):
    base = build_base(str(tmp_path / "base"), "qwen3", seed=8)
    lora = LoRARequest("a", 1, save_adapter(peft_model(base, 71), str(tmp_path / "a")))
    with make_llm(base, enable_sleep_mode=True) as llm:
        before = tokens(llm.generate(prompts(), greedy(), False, [lora, None, lora, None, lora]))
        llm.sleep(1)
        llm.wake_up()
        layers = llm.core.executor.runner.lora_layers.values()
        assert all(m.weight.data_ptr() == m.lora_ext.data_ptr() for m in layers)  # one buffer
        after = tokens(llm.generate(prompts(), greedy(), False, [lora, None, lora, None, lora]))
        assert (
            after == before and before[0] != tokens(llm.generate(prompts()[:1], greedy(), False))[0]
        )
