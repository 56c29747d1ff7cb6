"""The GPU kernel's view of a step (host side, NumPy): its rows grouped by adapter slot in blocks
of rows of one slot."""

import numpy as np


def block_rows(num_rows: int) -> int:
    """Rows per block for a step of ``num_rows`` rows: 16 for decode-sized steps, 64 above."""
    return 16 if num_rows <= 512 else 64


def max_blocks(num_rows: int, num_slots: int, block_m: int) -> int:
    """An upper bound on the blocks of any grouping of ``num_rows`` rows (slots and no slot)."""
    return -(-num_rows // block_m) + num_slots + 1


def block_table(slots: np.ndarray, num_rows: int, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``(blocks, order)``, int32. Row ``t`` runs slot ``slots[t]`` (-1, or ``t >= len(slots)``:
    none). ``order`` lists the ``num_rows`` rows grouped by slot (no slot last); ``blocks`` is
    ``[count, (slot, first, rows) * count]``: a block's rows are ``order[first : first + rows]``,
    at most ``block_rows(num_rows)`` of one slot (-1: none)."""
    key = np.full(num_rows, num_slots, dtype=np.int64)
    key[: len(slots)] = np.where(slots >= 0, slots, num_slots)
    order = np.argsort(key, kind="stable").astype(np.int32)
    counts = np.bincount(key, minlength=num_slots + 1)
    block_m, entries, first = block_rows(num_rows), [], 0
    for slot, count in enumerate(counts.tolist()):
        for offset in range(0, count, block_m):
            rows = min(block_m, count - offset)
            entries.append((slot if slot < num_slots else -1, first + offset, rows))
        first += count
    blocks = np.array([len(entries), *(v for e in entries for v in e)], dtype=np.int32)
    return blocks, order


def capture_table(max_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``block_table`` of ``max_rows`` rows of no slot, in order, 16-row blocks: valid for a
    graph's capture at any batch up to ``max_rows`` (the kernel clips blocks to its rows), so the
    captured runs copy the base output instead of leaving it unwritten."""
    count = -(-max_rows // 16)
    blocks = [count, *(v for i in range(count) for v in (-1, 16 * i, 16))]
    return np.array(blocks, dtype=np.int32), np.arange(max_rows, dtype=np.int32)
