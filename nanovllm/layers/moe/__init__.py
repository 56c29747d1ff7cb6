"""Mixture-of-Experts: the block models use (``layer``), the fused path and its torch reference
(``fused``), and the grouped-GEMM Triton kernels below them (``triton_kernels``, imported only when
the fused path runs)."""
from nanovllm.layers.moe.fused import MoeTile, fused_moe, fused_moe_torch
from nanovllm.layers.moe.layer import Experts, SparseMoeBlock, map_expert_tensor, select_experts

__all__ = ["Experts", "MoeTile", "SparseMoeBlock", "fused_moe", "fused_moe_torch", "map_expert_tensor", "select_experts"]
