"""Routing (top-k) and grouping of (token, k) pairs by expert as Triton kernels, with the results
of ``layer.select_experts`` and ``groups.group_by_expert``; no host sync (docs/moe.md)."""

import torch
import triton
import triton.language as tl

from nanovllm.layers.moe.groups import ID_DTYPES, ExpertGroups, max_padded_rows

MAX_ROUTED_EXPERTS = 256  # one program holds a token's logits, or a tile of pairs x experts
MAX_CHUNKS = 256  # programs of the grouping launches; each one sums the counts of all chunks


@triton.jit
def _select_experts_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_t,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One token: float32 softmax, then TOP_K times the largest logit left (lowest id among
    equals). grid: (num_tokens,)"""
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    real = offs_e < num_experts
    logits = tl.load(logits_ptr + token * stride_t + offs_e, mask=real, other=-float("inf")).to(
        tl.float32
    )
    exps = tl.where(real, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    total = tl.sum(exps, axis=0)

    offs_k = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    available = real
    for k in range(TOP_K):
        best = tl.max(tl.where(available, logits, -float("inf")), axis=0)
        expert = tl.min(tl.where(available & (logits == best), offs_e, BLOCK_E), axis=0)
        chosen = offs_e == expert
        weights = tl.where(
            offs_k == k, tl.sum(tl.where(chosen, exps, 0.0), axis=0) / total, weights
        )
        ids = tl.where(offs_k == k, expert, ids)
        available = available & ~chosen
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)  # lanes past TOP_K hold 0
    out = token * TOP_K + offs_k
    tl.store(weights_ptr + out, weights, mask=offs_k < TOP_K)
    tl.store(ids_ptr + out, ids, mask=offs_k < TOP_K)


@triton.jit
def _pair_tile(ids_ptr, start, end, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    offs_p = start + tl.arange(0, BLOCK_P)
    exists = offs_p < end
    experts = tl.load(ids_ptr + offs_p, mask=exists, other=-1)
    return offs_p, exists, experts[:, None] == tl.arange(0, BLOCK_E)[None, :]


# Counts that change with each step's tokens are not specialised on.
@triton.jit(do_not_specialize=["num_pairs", "chunk_size"])
def _count_kernel(
    ids_ptr, chunk_counts_ptr, num_pairs, chunk_size, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr
):
    # chunk_counts[c, e] = pairs of chunk c routed to expert e; grid: (num_chunks,)
    chunk = tl.program_id(0)
    start = chunk * chunk_size
    end = tl.minimum(start + chunk_size, num_pairs)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for sub in range(0, end - start, BLOCK_P):
        _, _, onehot = _pair_tile(ids_ptr, start + sub, end, BLOCK_P, BLOCK_E)
        counts += tl.sum(onehot.to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit(
    do_not_specialize=["num_pairs", "num_chunks", "chunk_size", "num_rows", "rows_per_program"]
)
def _scatter_kernel(
    ids_ptr,
    chunk_counts_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    expert_ends_ptr,
    num_pairs,
    num_chunks,
    chunk_size,
    num_rows,
    rows_per_program,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Chunk c's pairs into their rows, then the padding and block experts of program c's rows.
    grid: (at least num_chunks,)"""
    chunk = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs per expert
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs per expert in the chunks before this one
    for c in range(0, num_chunks, BLOCK_C):
        offs_c = c + tl.arange(0, BLOCK_C)
        # [BLOCK_C, BLOCK_E]
        counts = tl.load(
            chunk_counts_ptr + offs_c[:, None] * BLOCK_E + offs_e[None, :],
            mask=(offs_c < num_chunks)[:, None],
            other=0,
        )
        total += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((offs_c < chunk)[:, None], counts, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # 0 for the lanes past NUM_EXPERTS
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # chunk 0 only
    tl.store(expert_ends_ptr + offs_e, ends, mask=offs_e < tl.where(chunk == 0, NUM_EXPERTS, 0))

    # each pair's row: its expert's next free row, then that expert's row moves on by one
    start = chunk * chunk_size
    end = tl.minimum(start + chunk_size, num_pairs)
    next_row = starts + before
    for sub in range(0, end - start, BLOCK_P):  # no pass past the last chunk
        offs_p, exists, onehot = _pair_tile(ids_ptr, start + sub, end, BLOCK_P, BLOCK_E)
        hits = onehot.to(tl.int32)
        # [BLOCK_P, BLOCK_E]: earlier pairs of the tile, per expert
        earlier = tl.cumsum(hits, axis=0) - hits
        rows = tl.sum(tl.where(onehot, earlier + next_row[None, :], 0), axis=1)
        tl.store(sorted_pairs_ptr + rows, offs_p, mask=exists)
        next_row += tl.sum(hits, axis=0)

    # a row belongs to the first expert whose group ends after it (NUM_EXPERTS past the last group)
    # and holds a pair if it lies within that expert's count from the group's start
    real = offs_e < NUM_EXPERTS
    first_row = chunk * rows_per_program
    for sub in range(0, rows_per_program, BLOCK_P):
        offs_r = first_row + sub + tl.arange(0, BLOCK_P)
        in_layout = offs_r < num_rows
        expert = tl.sum(((ends[None, :] <= offs_r[:, None]) & real[None, :]).to(tl.int32), axis=1)
        # [BLOCK_P, BLOCK_E]; past the last group, a lane of count 0 or none: the row is padding
        of_expert = offs_e[None, :] == expert[:, None]
        group_start = tl.sum(tl.where(of_expert, starts[None, :], 0), axis=1)
        group_count = tl.sum(tl.where(of_expert, total[None, :], 0), axis=1)
        is_padding = offs_r - group_start >= group_count
        tl.store(
            sorted_pairs_ptr + offs_r,
            tl.zeros_like(offs_r) + num_pairs,
            mask=in_layout & is_padding,
        )
        tl.store(
            block_experts_ptr + offs_r // BLOCK_M, expert, mask=in_layout & (offs_r % BLOCK_M == 0)
        )


def select_experts_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer.select_experts`` in one launch: float32 weights and int32 ids [num_tokens, top_k],
    the same experts in the same order, weights up to float32 rounding."""
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(
            f"router_logits must be a floating-point [num_tokens, num_experts] tensor, got "
            f"shape {tuple(router_logits.shape)} and dtype {router_logits.dtype}"
        )
    num_tokens, num_experts = router_logits.shape
    if not 1 <= num_experts <= MAX_ROUTED_EXPERTS:
        raise ValueError(
            f"num_experts must be in [1, {MAX_ROUTED_EXPERTS}] for the routing kernel, "
            f"got {num_experts}"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    block_e = triton.next_power_of_2(num_experts)
    _select_experts_kernel[(num_tokens,)](
        logits,
        weights,
        ids,
        num_experts,
        logits.stride(0),
        TOP_K=top_k,
        RENORMALIZE=bool(renormalize),
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1 if block_e <= 128 else 2,
    )
    return weights, ids


def grouping_chunks(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(pairs per tile, pairs per chunk, number of chunks) for ``group_by_expert_triton``."""
    block_p = max(16, min(128, 8192 // triton.next_power_of_2(num_experts)))
    chunk_size = block_p * max(1, triton.cdiv(num_pairs, block_p * MAX_CHUNKS))
    return block_p, chunk_size, triton.cdiv(num_pairs, chunk_size)


def group_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGroups:
    """``groups.group_by_expert`` in two launches; ids must lie in [0, num_experts) (unchecked)."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in ID_DTYPES:
        raise ValueError(
            f"topk_ids must be an int32 or int64 [num_tokens, top_k] tensor, got shape "
            f"{tuple(topk_ids.shape)} and dtype {topk_ids.dtype}"
        )
    if not 1 <= num_experts <= MAX_ROUTED_EXPERTS:
        raise ValueError(
            f"num_experts must be in [1, {MAX_ROUTED_EXPERTS}] for the grouping kernels, "
            f"got {num_experts}"
        )
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    ids = topk_ids.contiguous().view(-1)  # [num_pairs]
    num_pairs = ids.numel()
    num_rows = max_padded_rows(num_pairs, num_experts, block_m)
    like = dict(dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.empty(num_rows, **like)
    block_experts = torch.empty(num_rows // block_m, **like)
    expert_ends = torch.empty(num_experts, **like)
    if num_pairs == 0:
        return ExpertGroups(sorted_pairs, block_experts, expert_ends.zero_())
    block_p, chunk_size, num_chunks = grouping_chunks(num_pairs, num_experts)
    block_e = triton.next_power_of_2(num_experts)
    chunk_counts = torch.empty(num_chunks, block_e, **like)  # [num_chunks, BLOCK_E]
    _count_kernel[(num_chunks,)](
        ids, chunk_counts, num_pairs, chunk_size, BLOCK_P=block_p, BLOCK_E=block_e
    )
    # more programs than chunks where the rows are many and the pairs few (decode: up to 15 padding
    # rows per used expert), so that no program walks many row tiles alone
    num_programs = max(num_chunks, min(triton.cdiv(num_rows, block_p), MAX_CHUNKS))
    rows_per_program = triton.cdiv(triton.cdiv(num_rows, num_programs), block_p) * block_p
    _scatter_kernel[(num_programs,)](
        ids,
        chunk_counts,
        sorted_pairs,
        block_experts,
        expert_ends,
        num_pairs,
        num_chunks,
        chunk_size,
        num_rows,
        rows_per_program,
        NUM_EXPERTS=num_experts,
        BLOCK_M=block_m,
        BLOCK_P=block_p,
        BLOCK_C=max(1, min(64, 8192 // block_e)),
        BLOCK_E=block_e,
    )
    return ExpertGroups(sorted_pairs, block_experts, expert_ends)
