"""Tile sizes of the Triton attention kernels, chosen to fit the GPU's shared memory."""

import functools
from typing import NamedTuple

# Shared memory a tile configuration may plan for, by ``shared_memory_estimate``: under the H100's
# and H200's 232448-byte limit per block, with room to spare.
SHARED_MEMORY_BUDGET = 200 * 1024
# (BLOCK_M, BLOCK_N, num_warps, num_stages), in order of preference: the first that fits the budget
# runs. 2-byte types with head_dim <= 128 get the first; float32 and head_dim 256 smaller ones.
PREFILL_TILES = (
    (128, 64, 8, 3),
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (64, 32, 4, 2),
    (32, 32, 4, 2),
    (16, 16, 4, 1),
)
# where no sequence has more than 64 new tokens, or head_dim > 128
SHORT_PREFILL_TILES = (
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (64, 32, 4, 2),
    (32, 32, 4, 2),
    (16, 16, 4, 1),
)
DECODE_TILES = (
    (128, 2),
    (64, 2),
    (32, 2),
    (16, 2),
    (16, 1),
)  # (BLOCK_N, num_stages); BLOCK_M is the padded group
# An FP8 cache gains from one more key tile in flight (its tiles are half the bytes); bf16 does not.
FP8_DECODE_TILES = ((128, 3),) + DECODE_TILES
# Decode holds a sequence's block ids in registers when a key tile lies within one cache block and
# the block table is at most this wide: the key and value loads then depend on no other load in
# the loop, so the compiler can buffer them ``num_stages - 1`` tiles ahead.
MAX_TABLE_IN_REGISTERS = 1024


class DecodeTile(NamedTuple):
    """Keys per loop step, pipeline stages and warps of a decode launch."""

    block_n: int
    num_stages: int
    num_warps: int = 4
    warp_specialize: bool = False  # Triton's automatic warp specialization of the key loop


def shared_memory_estimate(
    block_m: int, block_n: int, head_dim: int, num_stages: int, itemsize: int
) -> int:
    """Rough shared memory of one program: ``num_stages`` K and V tiles plus the Q tile."""
    return num_stages * (block_n * head_dim * 2) * itemsize + block_m * head_dim * itemsize


def prefill_tiles(head_dim: int, itemsize: int, max_seqlen_q: int) -> tuple[int, int, int, int]:
    short = max_seqlen_q <= 64 or head_dim > 128
    return _first_fitting(SHORT_PREFILL_TILES if short else PREFILL_TILES, head_dim, itemsize)


def decode_tiles(
    head_dim: int, itemsize: int, group_pad: int, fp8: bool = False
) -> tuple[int, int]:
    tiles = FP8_DECODE_TILES if fp8 else DECODE_TILES
    candidates = tuple((group_pad, block_n, 4, num_stages) for block_n, num_stages in tiles)
    _, block_n, _, num_stages = _first_fitting(candidates, head_dim, itemsize)
    return block_n, num_stages


@functools.lru_cache(maxsize=None)
def _first_fitting(candidates: tuple, head_dim: int, itemsize: int) -> tuple[int, int, int, int]:
    for block_m, block_n, num_warps, num_stages in candidates:
        if (
            shared_memory_estimate(block_m, block_n, head_dim, num_stages, itemsize)
            <= SHARED_MEMORY_BUDGET
        ):
            return block_m, block_n, num_warps, num_stages
    return candidates[-1]
