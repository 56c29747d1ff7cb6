"""Decode steps as CUDA graphs: captured once per batch size over static inputs, replayed with a
step's inputs sent in one copy. A graph takes each input token from the host or, while the host
does not know it yet, from the previous step's sampled ids on the device; with ``sample`` it also
computes the logits and draws the plain (temperature and seed) rows into those sampled ids, so
such a step is one copy and one graph launch."""
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import DecodeLayout, fill_decode
from nanovllm.utils.context import Context, step_context

TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}
NUM_STAGING = 2  # pinned host copies of the inputs, used in turn: one is filled while the last one's copy may be queued


class DecodeGraphs:
    """Graphs for batch sizes 1, 2, 4, 8, 16, 32, 48, ... up to ``max_batch``, captured largest first
    in one shared memory pool (``largest_only``: just the largest, which sizes that pool); a step
    replays the smallest that fits. ``sampled`` [>= max_batch] int64 holds each step's sampled ids
    on the device. ``sample``: the graphs end with the LM head (into ``logits``) and the fused
    draw; otherwise they end with the hidden states (tensor parallelism: the head gathers on rank 0
    outside the graph)."""

    @torch.inference_mode()
    def __init__(self, model: nn.Module, max_batch: int, max_blocks: int, hidden_size: int, vocab_size: int,
                 dtype: torch.dtype, device: torch.device, sync: Callable[[], None], sampled: torch.Tensor,
                 sample: bool, largest_only: bool = False):
        self.model, self.sampled, self.sample = model, sampled, sample
        self.layout = DecodeLayout(max_batch, max_blocks)
        self.buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=device)
        self.inputs = self.layout.fields(self.buffer, lambda part, dtype: part.view(TORCH_DTYPES[dtype]))
        self.staging = [torch.empty(self.layout.nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(NUM_STAGING)]
        self.staged = [self.layout.fields(s.numpy(), lambda part, dtype: part.view(dtype)) for s in self.staging]
        self.copied: list[torch.cuda.Event | None] = [None] * NUM_STAGING
        self.turn = 0
        with device:
            if sample:
                self.logits = torch.empty(max_batch, vocab_size, dtype=dtype)
            else:
                self.hidden = torch.empty(max_batch, hidden_size, dtype=dtype)
        sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
        self.batch_sizes = sorted(set(sizes))
        self._send([], max_batch, 1, None, None)  # every row padding: the captures write no cache slot
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for batch in self.batch_sizes[-1:] if largest_only else reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with step_context(self._context(batch)):
                self._forward(batch)  # warm-up
                with torch.cuda.graph(graph, pool):
                    self._forward(batch)
            if pool is None:
                pool = graph.pool()
            self.graphs[batch] = graph
            sync()

    def _context(self, batch: int) -> Context:
        v = self.inputs
        return Context(is_prefill=False, slot_mapping=v["slot_mapping"][:batch],
                       context_lens=v["context_lens"][:batch], block_tables=v["block_tables"][:batch])

    def _forward(self, batch: int) -> None:
        """What a graph runs: the input tokens, the model, and the head and draw (``sample``)."""
        v = self.inputs
        rows = v["prev_rows"][:batch]
        input_ids = torch.where(rows >= 0, self.sampled[rows.clamp(min=0)], v["input_ids"][:batch])
        hidden = self.model(input_ids, v["positions"][:batch])
        if not self.sample:
            self.hidden[:batch] = hidden
            return
        from nanovllm.layers.sampling_triton import gumbel_argmax

        logits = self.model.compute_logits(hidden, out=self.logits[:batch])
        gumbel_argmax(logits, v["temperatures"][:batch], v["seeds"][:batch], out=self.sampled[:batch])

    def fits(self, batch: int) -> bool:
        return batch <= self.batch_sizes[-1]

    def _send(self, seqs: list[Sequence], batch: int, block_size: int, prev_rows: list[int] | None,
              sampling: tuple[list[float], list[int]] | None) -> None:
        """Fill the next pinned copy of the inputs (once its last copy to the device is done) and
        queue its copy to the device buffer."""
        k = self.turn = (self.turn + 1) % NUM_STAGING
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        fill_decode(self.staged[k], seqs, batch, block_size, prev_rows, sampling)
        used = self.layout.used_bytes(batch)
        self.buffer[:used].copy_(self.staging[k][:used], non_blocking=True)
        self.copied[k] = torch.cuda.Event()
        self.copied[k].record()

    @torch.inference_mode()  # the buffers are inference tensors
    def replay(self, seqs: list[Sequence], block_size: int, prev_rows: list[int] | None,
               sampling: tuple[list[float], list[int]] | None) -> torch.Tensor:
        """Run a decode step of ``seqs``: the logits [n, vocab] (``sample``; rows with ``sampling``
        are drawn into ``sampled[:n]``), else the hidden states [n, hidden]."""
        n = len(seqs)
        batch = next(b for b in self.batch_sizes if b >= n)
        self._send(seqs, batch, block_size, prev_rows, sampling)
        self.graphs[batch].replay()
        return self.logits[:n] if self.sample else self.hidden[:n]
