"""Split-K in one kernel: each program of an output tile sums one range of K, and the last of
them to arrive adds the ranges' float32 sums in order (through L2), then sets the tile's arrival
counter back to 0 for the next call or graph replay (no second kernel)."""

import functools

import torch
import triton
import triton.language as tl

MAX_TILES = 4096  # output tiles a split call may have (one counter each)


@functools.cache
def counters(device: torch.device) -> torch.Tensor:
    """The arrival counters, all 0 between calls (each call's last programs set theirs back)."""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


@triton.jit
def sum_ranges(acc, partial_ptr, counter_ptr, offsets, mask, split, size, SPLIT_K: tl.constexpr):
    """Stores this range's ``acc`` at ``partial_ptr + split * size + offsets``; returns whether
    this program arrived last, and there the ranges' sum (zeros elsewhere)."""
    tl.store(partial_ptr + split * size + offsets, acc, mask=mask)
    tl.debug_barrier()  # the whole range's sum is written before the count releases it
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == SPLIT_K - 1
    total = tl.zeros_like(acc)
    if last:
        for s in range(SPLIT_K):  # from L2 (".cg"): other SMs wrote them
            part = partial_ptr + s * size + offsets
            total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter_ptr, 0)
    return last, total
