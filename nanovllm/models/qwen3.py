"""Qwen3 dense models: the Llama decoder with a per-head RMSNorm of q and k before RoPE."""

from nanovllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
