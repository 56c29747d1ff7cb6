"""A MoE step's (token, k) pairs grouped by expert, as the grouped GEMMs read them."""

from typing import NamedTuple

import torch

ID_DTYPES = (torch.int32, torch.int64)  # the expert ids' accepted dtypes


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    # every pair plus under block_m padding rows per used expert, in whole blocks
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m * block_m


class ExpertGroups(NamedTuple):
    """Pair p is token p // top_k's k-th choice; all int32."""

    sorted_pairs: torch.Tensor  # pair ids by expert, groups padded to block_m with num_pairs
    block_experts: torch.Tensor  # each block's expert, num_experts past the last group
    expert_ends: torch.Tensor  # cumulative padded group sizes


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGroups:
    # the torch reference of routing.group_by_expert_triton
    device = topk_ids.device
    expert_of_pair = topk_ids.flatten().long()  # [num_pairs]
    num_pairs = expert_of_pair.numel()
    num_rows = max_padded_rows(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    counts.scatter_add_(0, expert_of_pair, torch.ones(num_pairs, dtype=torch.int32, device=device))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    expert_ends = torch.cumsum(padded_counts, 0, dtype=torch.int32)
    padded_starts = expert_ends - padded_counts
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts

    order = torch.argsort(expert_of_pair, stable=True)  # [num_pairs] pair ids by expert
    sorted_experts = expert_of_pair[order]
    rank = torch.arange(num_pairs, device=device) - starts[sorted_experts]  # within its expert
    rows = padded_starts[sorted_experts] + rank
    sorted_pairs = torch.full((num_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, rows, order.to(torch.int32))

    block_starts = torch.arange(0, num_rows, block_m, dtype=torch.int32, device=device)
    block_experts = torch.searchsorted(expert_ends, block_starts, right=True, out_int32=True)
    return ExpertGroups(sorted_pairs, block_experts, expert_ends)
