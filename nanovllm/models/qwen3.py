"""Qwen3: per-head RMSNorm of q and k before RoPE."""

from nanovllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
