"""Qwen3-MoE: a sparse MoE block in place of the MLP in most layers."""

from torch import nn

from nanovllm.layers.moe import SparseMoeBlock, map_expert_tensor
from nanovllm.models.llama import GatedMLP
from nanovllm.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config, layer_idx: int) -> bool:
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in mlp_only and config.num_experts > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, config, layer_idx: int, quant_config, reduce_results: bool) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return SparseMoeBlock(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                config.norm_topk_prob,
                fp8=quant_config is not None,
                reduce_results=reduce_results,
            )
        hidden, inter, act = config.hidden_size, config.intermediate_size, config.hidden_act
        return GatedMLP(hidden, inter, act, False, quant_config, reduce_results)

    @staticmethod
    def map_checkpoint_name(name: str) -> tuple[str, tuple] | None:
        return map_expert_tensor(name)
