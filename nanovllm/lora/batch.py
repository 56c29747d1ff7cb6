"""Which rows of a step run which adapter slot, and a target layer's GEMM with its adapters."""

import numpy as np
import torch

from nanovllm.lora.blocks import block_table, capture_table, max_blocks


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
