"""SwiGLU experts: ``out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(gate_e @ x[t]) * (up_e @
x[t]))`` with e = topk_ids[t, k], as Triton kernels and as the torch reference (the CPU path)."""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanovllm.layers.moe.groups import ID_DTYPES, ExpertGroups, group_by_expert, max_padded_rows

__all__ = ["ExpertGroups", "MoeTile", "fused_moe", "fused_moe_torch", "group_by_expert"]
__all__ += ["max_padded_rows", "moe_tile"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class MoeTile(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (largest mean rows per expert, tile), first match wins (docs/moe.md). Mean rows per expert is
# num_tokens * top_k / num_experts: Qwen3-30B-A3B (128 experts, top-8) has 1/16 row per token.
MOE_TILES = (
    (16.0, MoeTile(16, 32, 128, 4, 4)),  # decode and small batches: weight-bound
    (48.0, MoeTile(32, 64, 64, 4, 4)),
    (256.0, MoeTile(64, 128, 64, 8, 3)),
    (float("inf"), MoeTile(128, 128, 64, 8, 3)),  # long prefills (~4k+ tokens on Qwen3-30B-A3B)
)


def moe_tile(num_tokens: int, top_k: int, num_experts: int, itemsize: int) -> MoeTile:
    # float32 keeps at most 2 stages, to stay within the H100's shared memory per block
    rows_per_expert = num_tokens * top_k / num_experts
    tile = next(tile for bound, tile in MOE_TILES if rows_per_expert <= bound)
    if itemsize >= 4:
        tile = tile._replace(num_stages=min(tile.num_stages, 2))
    return tile


def shared_memory_estimate(tile: MoeTile, itemsize: int) -> int:
    # of a gate/up program, the larger kernel
    return (
        tile.num_stages * (tile.block_m * tile.block_k + 2 * tile.block_k * tile.block_n) * itemsize
    )


def check_moe_inputs(hidden_states, w13, w2, topk_weights, topk_ids) -> None:
    """ValueError for bad inputs; the ids must lie in [0, num_experts) (unchecked: no host sync)."""
    if hidden_states.dim() != 2:
        raise ValueError(
            f"hidden_states must be [num_tokens, hidden], got shape {tuple(hidden_states.shape)}"
        )
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"hidden_states.dtype must be one of {SUPPORTED_DTYPES}, got {hidden_states.dtype}"
        )
    num_tokens, hidden = hidden_states.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] == 0 or w13.shape[1] % 2:
        raise ValueError(
            f"w13 must be [num_experts, 2 * inter, hidden={hidden}], got shape {tuple(w13.shape)}"
        )
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (num_experts, hidden, inter):
        expected = f"[num_experts={num_experts}, hidden={hidden}, inter={inter}]"
        raise ValueError(f"w2 must be {expected} like w13, got shape {tuple(w2.shape)}")
    for name, weight in (("w13", w13), ("w2", w2)):
        if weight.dtype != hidden_states.dtype:
            raise ValueError(
                f"{name}.dtype must equal hidden_states.dtype ({hidden_states.dtype}), "
                f"got {weight.dtype}"
            )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids must be [num_tokens={num_tokens}, top_k], got shape {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype not in ID_DTYPES:
        raise ValueError(f"topk_ids.dtype must be torch.int32 or torch.int64, got {topk_ids.dtype}")
    top_k = topk_ids.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and num_experts ({num_experts}), got {top_k}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
            f"got {tuple(topk_weights.shape)}"
        )
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights.dtype must be torch.float32, got {topk_weights.dtype}")
    devices = {t.device for t in (hidden_states, w13, w2, topk_weights, topk_ids)}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def fused_moe(
    hidden_states, w13, w2, topk_weights, topk_ids, tile: MoeTile | None = None
) -> torch.Tensor:
    """The Triton path, CUDA-graph safe; ``tile`` overrides ``moe_tile``'s choice."""
    from nanovllm.layers.moe.routing import MAX_ROUTED_EXPERTS, group_by_expert_triton
    from nanovllm.layers.moe.triton_kernels import launch_down, launch_gate_up, sum_pairs

    check_moe_inputs(hidden_states, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden = hidden_states.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    tile = tile or moe_tile(num_tokens, top_k, num_experts, hidden_states.element_size())
    group = group_by_expert_triton if num_experts <= MAX_ROUTED_EXPERTS else group_by_expert
    groups = group(topk_ids, num_experts, tile.block_m)
    num_pairs = num_tokens * top_k

    # [max_padded_rows, inter]: row r is the SiLU-and-mul of the pair at sorted_pairs[r]
    like = dict(dtype=hidden_states.dtype, device=hidden_states.device)
    intermediate = torch.empty(groups.sorted_pairs.numel(), inter, **like)
    launch_gate_up(hidden_states, w13, intermediate, groups, top_k, num_pairs, tile)
    pair_out = torch.empty(num_pairs, hidden, **like)  # row token * top_k + k: weighted output
    launch_down(intermediate, w2, pair_out, topk_weights.reshape(-1), groups, num_pairs, tile)
    return sum_pairs(pair_out, top_k, hidden_states.dtype)


def pairs_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """(expert, its tokens, their weights [pairs, 1]) per routed expert; syncs with the host."""
    num_tokens, top_k = topk_ids.shape
    expert_of_pair = topk_ids.flatten()
    token_of_pair = torch.arange(num_tokens, device=topk_ids.device).repeat_interleave(top_k)
    weight_of_pair = topk_weights.flatten()
    for expert in expert_of_pair.unique().tolist():
        pairs = (expert_of_pair == expert).nonzero().squeeze(1)
        yield expert, token_of_pair[pairs], weight_of_pair[pairs, None]


def fused_moe_torch(hidden_states, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The reference and CPU path: float32 matmuls, one routed expert at a time."""
    check_moe_inputs(hidden_states, w13, w2, topk_weights, topk_ids)
    inter = w13.shape[1] // 2
    x = hidden_states.float()
    out = torch.zeros_like(x)
    for expert, tokens, weights in pairs_by_expert(topk_ids, topk_weights):
        gate_up = x[tokens] @ w13[expert].float().T  # [pairs, 2 * inter]
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (h @ w2[expert].float().T) * weights)
    return out.to(hidden_states.dtype)
