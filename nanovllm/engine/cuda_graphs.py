"""Decode steps as CUDA graphs: captured once per batch size over static input buffers, replayed
with a step's inputs copied in (padding rows write to slot -1)."""
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.utils.context import Context, step_context


class DecodeGraphs:
    """Graphs for batch sizes 1, 2, 4, 8, 16, 32, 48, ... up to ``max_batch``, captured largest first
    in one shared memory pool (``largest_only``: just the largest, which sizes that pool); a step
    replays the smallest that fits."""

    @torch.inference_mode()
    def __init__(self, model: nn.Module, max_batch: int, max_blocks: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, sync: Callable[[], None], largest_only: bool = False):
        with device:
            self.buffers = dict(
                input_ids=torch.zeros(max_batch, dtype=torch.int64),
                positions=torch.zeros(max_batch, dtype=torch.int64),
                slot_mapping=torch.full((max_batch,), -1, dtype=torch.int32),
                context_lens=torch.zeros(max_batch, dtype=torch.int32),
                block_tables=torch.zeros(max_batch, max_blocks, dtype=torch.int32),
                outputs=torch.zeros(max_batch, hidden_size, dtype=dtype),
            )
        v = self.buffers
        sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
        self.batch_sizes = sorted(set(sizes))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for batch in self.batch_sizes[-1:] if largest_only else reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            context = Context(
                is_prefill=False,
                slot_mapping=v["slot_mapping"][:batch],
                context_lens=v["context_lens"][:batch],
                block_tables=v["block_tables"][:batch],
            )
            with step_context(context):
                v["outputs"][:batch] = model(v["input_ids"][:batch], v["positions"][:batch])  # warm-up
                with torch.cuda.graph(graph, pool):
                    v["outputs"][:batch] = model(v["input_ids"][:batch], v["positions"][:batch])
            if pool is None:
                pool = graph.pool()
            self.graphs[batch] = graph
            sync()

    def fits(self, batch: int) -> bool:
        return batch <= self.batch_sizes[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """The hidden states [batch, hidden] of one decode step."""
        batch = input_ids.size(0)
        v = self.buffers
        v["input_ids"][:batch] = input_ids
        v["positions"][:batch] = positions
        v["slot_mapping"].fill_(-1)
        v["slot_mapping"][:batch] = context.slot_mapping
        v["context_lens"].zero_()
        v["context_lens"][:batch] = context.context_lens
        v["block_tables"][:batch, : context.block_tables.size(1)] = context.block_tables
        self.graphs[next(b for b in self.batch_sizes if b >= batch)].replay()
        return v["outputs"][:batch]
