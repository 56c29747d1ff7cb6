"""The (token, k) pairs of a MoE step grouped by expert, in torch (no host synchronisation): the
layout the grouped GEMMs read, and the reference of ``routing.group_by_expert_triton``."""

from typing import NamedTuple

import torch


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the grouped layout can need: every pair, plus fewer than ``block_m`` padding rows
    for each expert that gets a pair (at most min(num_experts, num_pairs) of them), rounded down to
    a multiple of ``block_m`` (the layout is made of whole blocks)."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m * block_m


class ExpertGroups(NamedTuple):
    """The (token, k) pairs laid out by expert. Pair p is token p // top_k's k = p % top_k.

    ``sorted_pairs`` [max_padded_rows]: int32 pair ids, expert 0's pairs first (in pair order), each
    expert's group padded to a multiple of block_m with the sentinel ``num_pairs``; rows past the
    end of the last group hold the sentinel too. ``block_experts`` [max_padded_rows // block_m]:
    int32 expert of each block of block_m rows (num_experts past the end). ``expert_ends``
    [num_experts]: int32 cumulative padded group sizes; the last is the number of rows in use."""

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor
    expert_ends: torch.Tensor


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGroups:
    """Group the pairs by expert with device-side torch ops only (no host synchronisation)."""
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
    rank = (
        torch.arange(num_pairs, device=device) - starts[sorted_experts]
    )  # position within its expert
    rows = padded_starts[sorted_experts] + rank
    sorted_pairs = torch.full((num_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, rows, order.to(torch.int32))

    block_starts = torch.arange(0, num_rows, block_m, dtype=torch.int32, device=device)
    block_experts = torch.searchsorted(expert_ends, block_starts, right=True, out_int32=True)
    return ExpertGroups(sorted_pairs, block_experts, expert_ends)
