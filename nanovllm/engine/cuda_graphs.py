"""Decode steps as CUDA graphs: the model's forward pass captured once per batch size over the
decode buffer's device fields (``step_inputs.DecodeBuffer``), replayed after a step's inputs are
sent. Each graph takes an input token from the host or, while the host does not know it yet, from
the previous step's sampled ids on the device, so a step is one copy and one graph launch; the LM
head and the sampler run after it."""
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.engine.step_inputs import DecodeBuffer, decode_inputs
from nanovllm.utils.context import step_context


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, and ``max_batch`` itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Graphs for the batch sizes of ``graph_batch_sizes(max_batch)``, captured largest first in
    one shared memory pool (``largest_only``: just the largest, which sizes that pool). ``sampled``
    [>= max_batch] int64 holds each step's sampled ids on the device."""

    @torch.inference_mode()
    def __init__(self, model: nn.Module, inputs: DecodeBuffer, sampled: torch.Tensor, max_batch: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, sync: Callable[[], None],
                 largest_only: bool = False):
        self.model, self.inputs, self.sampled = model, inputs, sampled
        self.hidden = torch.empty(max_batch, hidden_size, dtype=dtype, device=device)
        self.batch_sizes = graph_batch_sizes(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for batch in self.batch_sizes[-1:] if largest_only else reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            input_ids, positions, context = decode_inputs(inputs.fields, sampled, batch)
            with step_context(context):
                self.hidden[:batch] = model(input_ids, positions)  # warm-up
                with torch.cuda.graph(graph, pool):
                    input_ids, positions, context = decode_inputs(inputs.fields, sampled, batch)
                    self.hidden[:batch] = model(input_ids, positions)
            if pool is None:
                pool = graph.pool()
            self.graphs[batch] = graph
            sync()

    def padded_batch(self, n: int) -> int | None:
        """The batch size of the smallest graph that fits ``n`` rows, or None when none does."""
        if n > self.batch_sizes[-1]:
            return None
        return next(b for b in self.batch_sizes if b >= n)

    def replay(self, n: int, batch: int) -> torch.Tensor:
        """Run the graph of ``batch`` rows over the inputs already sent; the hidden states [n, hidden]."""
        self.graphs[batch].replay()
        return self.hidden[:n]
