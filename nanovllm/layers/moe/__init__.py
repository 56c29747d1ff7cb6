"""Mixture-of-Experts: the block models use (``layer``), the fused path and its torch reference
(``fused``), and the Triton kernels below them, imported only when the fused path runs: routing and
grouping (``routing``) and the grouped GEMMs (``triton_kernels``)."""

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
