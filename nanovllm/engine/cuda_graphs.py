"""Decode steps as CUDA graphs: the model's forward pass captured once per batch size over the
decode buffer's device fields (``step_inputs.DecodeBuffer``), replayed after a step's inputs are
sent. Each graph takes an input token from the host or, while the host does not know it yet, from
the previous step's sampled ids on the device. On one GPU (``draw``) a graph also ends with the LM
head and the fused temperature draw of every row into those sampled ids, so a step whose rows all
sample plainly (``SamplingRows.plain``) is one copy and one graph launch; any other step samples
again from the graph's logits. With tensor parallelism a graph ends with the hidden states (the LM
head gathers the logits on rank 0 outside it)."""
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
                 hidden_size: int, vocab_size: int, dtype: torch.dtype, device: torch.device,
                 sync: Callable[[], None], draw: bool, largest_only: bool = False):
        self.model, self.inputs, self.sampled, self.draw = model, inputs, sampled, draw
        with device:
            self.out = torch.empty(max_batch, vocab_size if draw else hidden_size, dtype=dtype)
        self.batch_sizes = graph_batch_sizes(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for batch in self.batch_sizes[-1:] if largest_only else reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            self._forward(batch)  # warm-up
            with torch.cuda.graph(graph, pool):
                self._forward(batch)
            if pool is None:
                pool = graph.pool()
            self.graphs[batch] = graph
            sync()

    def _forward(self, batch: int) -> None:
        """What a graph runs: the input tokens, the model, and with ``draw`` the LM head and the draw."""
        v = self.inputs.fields
        input_ids, positions, context = decode_inputs(v, self.sampled, batch)
        with step_context(context):
            hidden = self.model(input_ids, positions)
            if not self.draw:
                self.out[:batch] = hidden
                return
            from nanovllm.sampling.triton_draw import gumbel_argmax

            logits = self.model.compute_logits(hidden, out=self.out[:batch])
            gumbel_argmax(logits, v["temperatures"][:batch], v["seeds"][:batch], out=self.sampled[:batch])

    def padded_batch(self, n: int) -> int | None:
        """The batch size of the smallest graph that fits ``n`` rows, or None when none does."""
        if n > self.batch_sizes[-1]:
            return None
        return next(b for b in self.batch_sizes if b >= n)

    def replay(self, n: int, batch: int) -> torch.Tensor:
        """Run the graph of ``batch`` rows over the inputs already sent: the logits [n, vocab], the
        rows drawn into ``sampled[:n]`` (``draw``), else the hidden states [n, hidden]."""
        self.graphs[batch].replay()
        return self.out[:n]
