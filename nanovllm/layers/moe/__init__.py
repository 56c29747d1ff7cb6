"""MoE layers (docs/moe.md)."""

from nanovllm.layers.moe.fused import MoeTile, fused_moe, fused_moe_torch
from nanovllm.layers.moe.layer import Experts, SparseMoeBlock, map_expert_tensor, select_experts

__all__ = [
    "Experts",
    "MoeTile",
    "SparseMoeBlock",
    "fused_moe",
    "fused_moe_torch",
    "map_expert_tensor",
    "select_experts",
]
