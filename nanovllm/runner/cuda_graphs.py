"""Decode steps as CUDA graphs, one per batch size, over the decode buffer's device fields. A graph
ends with the LM head and the fused temperature draw of every row into ``sampled``, so a plain step
is one copy and one launch; with tensor parallelism each rank draws over its share of the
vocabulary and the ranks exchange each row's winners inside the graph."""

from collections.abc import Callable

import torch
from torch import nn

from nanovllm.runner.step_inputs import DecodeBuffer, decode_inputs
from nanovllm.utils.context import step_context


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, and ``max_batch`` itself."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return sorted(set(small + list(range(16, max_batch, 16)) + [max_batch]))


class DecodeGraphs:
    """Graphs of ``graph_batch_sizes(max_batch)``, captured largest first in one memory pool
    (``largest_only``: just the largest). ``sampled`` [>= max_batch] int64: each step's tokens."""

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
            vocab = (self.head.vocab_start, self.head.num_embeddings)
            sharded_gumbel_argmax(logits, temperatures, seeds, *vocab, out)

    def padded_batch(self, n: int) -> int | None:
        """The batch size of the smallest graph that fits ``n`` rows, or None when none does."""
        if n > self.batch_sizes[-1]:
            return None
        return next(b for b in self.batch_sizes if b >= n)

    def replay(self, n: int, batch: int) -> torch.Tensor:
        """Run the graph of ``batch`` rows over the inputs sent: this rank's logits [n, its share of
        the vocabulary]; the rows drawn into ``sampled[:n]``."""
        self.graphs[batch].replay()
        return self.out[:n]
