"""MoE with FP8 expert weights: the torch reference (the CPU path) and the Triton path."""

import torch
import torch.nn.functional as F

from nanovllm.layers.moe.fused import group_by_expert, moe_tile, pairs_by_expert
from nanovllm.quantization.fp8 import BLOCK, FP8_DTYPE, fp8_linear


def check_fp8_experts(w13: torch.Tensor, w2: torch.Tensor) -> None:
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"w13 and w2 must be {FP8_DTYPE}, got {w13.dtype} and {w2.dtype}")


def fused_moe_torch_fp8(
    hidden_states, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids
) -> torch.Tensor:
    """e4m3 ``w13`` [experts, 2 * inter, hidden] and ``w2`` [experts, hidden, inter] with their
    per-expert block scales."""
    check_fp8_experts(w13, w2)
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for expert, tokens, weights in pairs_by_expert(topk_ids, topk_weights):
        gate_up = fp8_linear(
            hidden_states[tokens], w13[expert], w13_scale[expert], out_dtype=torch.float32
        )
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden_states.dtype)
        # [pairs, hidden]
        down = fp8_linear(h, w2[expert], w2_scale[expert], out_dtype=torch.float32)
        out.index_add_(0, tokens, down * weights)
    return out.to(hidden_states.dtype)


def fused_moe_fp8(
    hidden_states, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, precise: bool | None = None
) -> torch.Tensor:
    """``fused_moe_torch_fp8`` in Triton kernels, CUDA-graph safe."""
    from nanovllm.layers.moe.routing import MAX_ROUTED_EXPERTS, group_by_expert_triton
    from nanovllm.layers.moe.triton_fp8 import launch_down_fp8, launch_gate_up_fp8
    from nanovllm.layers.moe.triton_kernels import sum_pairs
    from nanovllm.quantization import fp8_triton

    check_fp8_experts(w13, w2)
    num_tokens, hidden = hidden_states.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    if inter % BLOCK:
        raise ValueError(
            f"the experts' intermediate size must be a multiple of {BLOCK} for FP8, got {inter}"
        )
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    precise = fp8_triton.PRECISE if precise is None else precise
    tile = moe_tile(num_tokens, top_k, num_experts, 1)
    tile = tile._replace(block_n=min(tile.block_n, BLOCK))  # one weight scale per tile and k-block
    group = group_by_expert_triton if num_experts <= MAX_ROUTED_EXPERTS else group_by_expert
    groups = group(topk_ids, num_experts, tile.block_m)
    num_pairs = num_tokens * top_k
    q, x_scale = fp8_triton.quantize_rows(hidden_states.contiguous())
    intermediate = torch.empty(
        groups.sorted_pairs.numel(), inter, dtype=hidden_states.dtype, device=hidden_states.device
    )
    launch_gate_up_fp8(
        q, x_scale, w13, w13_scale, intermediate, groups, top_k, num_pairs, tile, precise
    )
    qh, h_scale = fp8_triton.quantize_rows(intermediate)
    pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=hidden_states.device)
    launch_down_fp8(
        qh,
        h_scale,
        w2,
        w2_scale,
        pair_out,
        topk_weights.reshape(-1),
        groups,
        num_pairs,
        tile,
        precise,
    )
    return sum_pairs(pair_out, top_k, hidden_states.dtype)
