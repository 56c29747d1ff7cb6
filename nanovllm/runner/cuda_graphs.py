"""Decode steps as CUDA graphs: the model's forward pass captured once per batch size over the
decode buffer's device fields (``step_inputs.DecodeBuffer``), replayed after a step's inputs are
sent. Each graph takes an input token from the host or, while the host does not know it yet, from
the previous step's sampled ids on the device. A graph ends with the LM head and the fused
temperature draw of every row into those sampled ids, so a step whose rows all sample plainly
(``SamplingRows.plain``) is one copy and one graph launch; any other step samples again from the
graph's logits. With tensor parallelism each rank's graph computes its share of the vocabulary's
logits and draws over it, and the ranks exchange each row's winners inside the graph, so every rank
holds the step's tokens (``triton_draw.sharded_gumbel_argmax``); another step gathers the shares
on rank 0 to sample there."""

from collections.abc import Callable

import torch
from torch import nn

from nanovllm.runner.step_inputs import DecodeBuffer, decode_inputs
from nanovllm.utils.context import step_context


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, and ``max_batch`` itself."""
    sizes = (
        [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    )
    return sorted(set(sizes))


class DecodeGraphs:
    """Graphs for the batch sizes of ``graph_batch_sizes(max_batch)``, captured largest first in
    one shared memory pool (``largest_only``: just the largest, which sizes that pool). ``sampled``
    [>= max_batch] int64 holds each step's sampled ids on the device."""

    @torch.inference_mode()
    def __init__(
        self,
        model: nn.Module,
        inputs: DecodeBuffer,
        sampled: torch.Tensor,
        max_batch: int,
        dtype: torch.dtype,
        device: torch.device,
        sync: Callable[[], None],
        largest_only: bool = False,
    ):
        self.model, self.inputs, self.sampled = model, inputs, sampled
        self.head = model.lm_head  # this rank's share of the vocabulary
        with device:
            self.out = torch.empty(max_batch, self.head.num_embeddings_per_rank, dtype=dtype)
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
        """What a graph runs: the input tokens, the model, the LM head and the draw."""
        from nanovllm.sampling.triton_draw import gumbel_argmax, sharded_gumbel_argmax

        v = self.inputs.fields
        input_ids, positions, context = decode_inputs(v, self.sampled, batch)
        with step_context(context):
            logits = self.model.compute_logits(
                self.model(input_ids, positions), out=self.out[:batch], gather=False
            )
        temperatures, seeds, out = (
            v["temperatures"][:batch],
            v["seeds"][:batch],
            self.sampled[:batch],
        )
        if self.head.tp_size == 1:
            gumbel_argmax(logits, temperatures, seeds, out=out)
        else:
            sharded_gumbel_argmax(
                logits, temperatures, seeds, self.head.vocab_start, self.head.num_embeddings, out
            )

    def padded_batch(self, n: int) -> int | None:
        """The batch size of the smallest graph that fits ``n`` rows, or None when none does."""
        if n > self.batch_sizes[-1]:
            return None
        return next(b for b in self.batch_sizes if b >= n)

    def replay(self, n: int, batch: int) -> torch.Tensor:
        """Run the graph of ``batch`` rows over the inputs already sent: this rank's logits [n,
        its share of the vocabulary], the rows drawn into ``sampled[:n]``."""
        self.graphs[batch].replay()
        return self.out[:n]
