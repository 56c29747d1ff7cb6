"""Which rows of a step run which adapter slot, and a target layer's GEMM with its adapters."""

import numpy as np
import torch


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


class AdapterBatch:
    """The step's rows grouped by slot for the GPU kernel (``blocks`` and ``order``, device
    buffers a CUDA graph reads; see ``block_table``), and as ``groups`` on the CPU.
    Inactive: no row has an adapter and no graph runs, so the layers run the base GEMM alone."""

    def __init__(self, max_loras: int, max_rows: int, device: torch.device):
        capacity = 1 + 3 * max_blocks(max_rows, max_loras, 16)
        # blocks, then order, in one buffer: one copy to the device per step
        self.meta = torch.zeros(capacity + max_rows, dtype=torch.int32, device=device)
        self.blocks, self.order = self.meta[:capacity], self.meta[capacity:]
        self.num_slots = max_loras
        self.active = False
        self.groups: list[tuple[int, torch.Tensor]] = []  # (slot, rows) on the CPU

    def set_rows(self, slots: np.ndarray, num_rows: int, graphed: bool) -> None:
        """Row ``t`` runs slot ``slots[t]`` (-1: the base model) of the step's ``num_rows`` rows
        (a CUDA graph's padded batch: rows past ``len(slots)`` run none); ``graphed``: a graph
        replays this step, so the buffers are written whatever the rows."""
        self.active = graphed or bool((slots >= 0).any())
        self.groups = []
        if not self.active:
            return
        if not self.meta.is_cuda:
            for slot in np.unique(slots[slots >= 0]).tolist():
                self.groups.append((slot, torch.from_numpy(np.flatnonzero(slots == slot))))
            return
        blocks, order = block_table(slots, num_rows, self.num_slots)
        host = np.zeros(len(self.blocks) + num_rows, dtype=np.int32)
        host[: len(blocks)], host[len(self.blocks) :] = blocks, order
        self.meta[: len(host)].copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)

    def capturing(self) -> None:
        """CUDA graphs are being captured: the kernels run over rows of no slot, so each captured
        run writes the base model's output rather than leaving it unwritten."""
        blocks, order = capture_table(len(self.order))
        self.blocks[: len(blocks)].copy_(torch.from_numpy(blocks))
        self.order.copy_(torch.from_numpy(order))
        self.active, self.groups = True, []


def lora_linear(layer, x: torch.Tensor, bias: torch.Tensor | None, base, batch) -> torch.Tensor:
    """``layer``'s linear with ``y[t] += (x[t] A_s^T) B_s^T`` for the rows ``t`` of each slot
    ``s``: on a GPU one GEMM over the weight and every slot's A (``layer.lora_ext``) and one
    Triton kernel; elsewhere the base method, then one product per slot."""
    if x.is_cuda:
        from nanovllm.lora.triton_ops import launch_lora

        return launch_lora(x, layer.lora_ext, layer.lora_b, bias, batch.blocks, batch.order)
    y = base.apply(layer, x, bias)
    for slot, rows in batch.groups:
        y.index_add_(0, rows, (x[rows] @ layer.lora_a[slot].T) @ layer.lora_b[slot].T)
    return y
