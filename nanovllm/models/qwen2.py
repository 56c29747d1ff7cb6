"""Qwen2 and Qwen2.5: biases on q/k/v."""

from nanovllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def attention_biases(self, config) -> tuple[bool, bool]:
        return True, False
