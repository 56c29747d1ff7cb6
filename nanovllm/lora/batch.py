"""Which rows of a step run which adapter slot, and the LoRA update of a layer's output."""

import numpy as np
import torch


class AdapterBatch:
    """The step's rows grouped by slot: ``order[starts[s] : starts[s] + counts[s]]`` are slot
    ``s``'s rows (device buffers a CUDA graph reads); ``groups`` the same on the host. Inactive:
    no row has an adapter and no graph runs, so the layers skip LoRA."""

    def __init__(self, max_loras: int, max_rows: int, device: torch.device):
        # counts, starts, then order, in one buffer: one copy to the device per step
        self.meta = torch.zeros(2 * max_loras + max_rows, dtype=torch.int32, device=device)
        self.counts, self.starts = self.meta[:max_loras], self.meta[max_loras : 2 * max_loras]
        self.order = self.meta[2 * max_loras :]
        self.num_slots = max_loras
        self.active = False
        self.max_rows: int | None = None  # bounds the kernels' grid (None: all the rows)
        self.groups: list[tuple[int, torch.Tensor]] = []  # (slot, rows) on the CPU

    def set_rows(self, slots: np.ndarray, graphed: bool) -> None:
        """Row ``t`` runs slot ``slots[t]`` (-1: the base model); ``graphed``: a CUDA graph
        replays this step, so its buffers are written whatever the rows."""
        used = slots >= 0
        self.active = graphed or bool(used.any())
        self.groups = []
        if not self.active:
            return
        order = np.argsort(slots, kind="stable")[int((~used).sum()) :].astype(np.int32)
        counts = np.bincount(slots[used], minlength=self.num_slots).astype(np.int32)
        starts = (np.cumsum(counts) - counts).astype(np.int32)
        meta = torch.from_numpy(np.concatenate([counts, starts, order]))
        if self.meta.is_cuda:
            meta = meta.pin_memory()
        self.meta[: len(meta)].copy_(meta, non_blocking=True)
        self.max_rows = None if graphed else int(counts.max())
        if not self.meta.is_cuda:
            rows = torch.from_numpy(order).long()
            self.groups = [(s, rows[starts[s] : starts[s] + n]) for s, n in enumerate(counts) if n]

    def capturing(self) -> None:
        """A CUDA graph is being captured: the kernels run, over every row, with no rows yet."""
        self.counts.zero_()
        self.active, self.max_rows, self.groups = True, None, []


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch) -> None:
    """``y[t] += (x[t] a[s]^T) b[s]^T`` for the rows ``t`` of each slot ``s``: Triton on a GPU,
    one product per slot in torch elsewhere."""
    if y.is_cuda:
        from nanovllm.lora.triton_ops import launch_lora

        rows = batch.max_rows if batch.max_rows is not None else y.shape[0]
        launch_lora(y, x, a, b, batch.order, batch.starts, batch.counts, rows)
        return
    for slot, rows in batch.groups:
        y.index_add_(0, rows, (x[rows] @ a[slot].T) @ b[slot].T)
