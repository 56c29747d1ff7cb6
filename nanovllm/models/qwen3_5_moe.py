"""Qwen3.5-MoE: Qwen3.5's hybrid layers with a sparse MoE block in place of every MLP, plus a shared
expert scaled by sigmoid(``shared_expert_gate``); Qwen3-Next reuses the block."""

import torch
from torch import nn

from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.moe import SparseMoeBlock, map_expert_tensor
from nanovllm.models.llama import GatedMLP
from nanovllm.models.qwen3_5 import Qwen3_5ForCausalLM
from nanovllm.parallel.distributed import all_reduce


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts (softmax top-k, renormalised when ``renormalize``) plus ``shared_expert``
    times sigmoid(``shared_expert_gate``); under tensor parallelism one all-reduce sums both."""

    def __init__(self, config, renormalize: bool = True):
        hidden = config.hidden_size
        args = (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size)
        super().__init__(hidden, *args, renormalize, reduce_results=False)
        inter = config.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(hidden, inter, config.hidden_act, reduce_results=False)
        self.shared_expert_gate = ReplicatedLinear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out = super().forward(x) + shared
        if self.tp_size > 1:
            all_reduce(out)
        return out


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Hugging Face's ``Qwen3_5MoeForCausalLM`` names; experts per expert or fused
    (transformers 5's ``experts.gate_up_proj`` / ``experts.down_proj``)."""

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return SharedExpertMoeBlock(config)

    @classmethod
    def map_text_name(cls, name: str) -> tuple[str, tuple]:
        return map_expert_tensor(name) or super().map_text_name(name)
