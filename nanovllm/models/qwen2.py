"""Qwen2 and Qwen2.5: the Llama decoder with biases on q/k/v (none on the output projection)."""

from nanovllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def attention_biases(self, config) -> tuple[bool, bool]:
        return True, False
