"""Decode steps as CUDA graphs, one per batch size and input turn: each copies its turn's host
inputs in (``DecodeBuffer.stage``), ends with the LM head and the draw, and writes the drawn tokens
to the pinned ``host_tokens[turn]``, so that a step queues no copy of its own."""

import torch

from nanovllm.runner.step_inputs import decode_inputs
from nanovllm.runner.step_output import StepOutput
from nanovllm.utils.context import step_context


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, and ``max_batch`` itself."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return sorted(set(small + list(range(16, max_batch, 16)) + [max_batch]))


class DecodeGraphs:
    """Captured largest first in one memory pool (``largest_only``: just the largest)."""

    @torch.inference_mode()
    def __init__(self, runner, largest_only: bool = False):
        model, sampled = runner.model, runner.sampled
        self.model, self.inputs, self.sampled = model, runner.decode_buffer, sampled
        self.head = model.lm_head  # this rank's share of the vocabulary
        max_batch = min(runner.config.max_num_seqs, 512)
        turns = len(self.inputs.staging)
        self.host_tokens = torch.zeros(turns, max_batch, dtype=torch.int64, pin_memory=True)
        self.held: list[StepOutput | None] = [None] * turns  # the output reading host_tokens[k]
        with runner.device:
            shape = (max_batch, self.head.num_embeddings_per_rank)
            self.out = torch.empty(*shape, dtype=runner.dtype)
        self.batch_sizes = graph_batch_sizes(max_batch)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        pool = None
        for batch in self.batch_sizes[-1:] if largest_only else reversed(self.batch_sizes):
            for turn in range(turns):
                graph = torch.cuda.CUDAGraph()
                self._forward(batch, turn)  # warm-up
                with torch.cuda.graph(graph, pool):
                    self._forward(batch, turn)
                if pool is None:
                    pool = graph.pool()
                self.graphs[batch, turn] = graph
                runner.sync()

    def _forward(self, batch: int, turn: int) -> None:
        from nanovllm.runner.host_copy import copy_words
        from nanovllm.sampling.triton_draw import gumbel_argmax, sharded_gumbel_argmax

        self.inputs.stage(turn, batch)
        v = self.inputs.fields
        input_ids, positions, context = decode_inputs(v, self.sampled, batch)
        with step_context(context):
            hidden_states = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden_states, out=self.out[:batch], gather=False)
        temperatures, seeds = v["temperatures"][:batch], v["seeds"][:batch]
        out = self.sampled[:batch]
        if self.head.tp_size == 1:
            gumbel_argmax(logits, temperatures, seeds, out=out)
        else:
            vocab = (self.head.vocab_start, self.head.num_embeddings)
            sharded_gumbel_argmax(logits, temperatures, seeds, *vocab, out)
        copy_words(out, self.host_tokens[turn], out.nbytes)

    def padded_batch(self, n: int) -> int | None:
        """The smallest graph batch that fits ``n`` rows, or None."""
        return next((b for b in self.batch_sizes if b >= n), None)

    def replay(self, n: int, batch: int, turn: int) -> torch.Tensor:
        """Logits of the first ``n`` rows; their tokens are drawn into ``sampled[:n]`` too."""
        if self.held[turn] is not None:  # the step before last's tokens, about to be rewritten
            self.held[turn].keep()
            self.held[turn] = None
        self.graphs[batch, turn].replay()
        self.inputs.done()
        return self.out[:n]

    def output(self, n: int, turn: int, wait) -> StepOutput:
        """The drawn tokens of the step just replayed, read from ``host_tokens[turn]``."""
        self.held[turn] = StepOutput(self.sampled[:n], wait, host=self.host_tokens[turn, :n])
        return self.held[turn]
