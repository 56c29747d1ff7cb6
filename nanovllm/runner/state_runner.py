"""The model runner of a hybrid model: per-sequence recurrent states of its linear-attention
layers, in slots the block manager hands out (``Step.state_slots``)."""

from itertools import accumulate

import numpy as np
import torch

from nanovllm.engine.step import Step
from nanovllm.layers.linear_attention.states import StateBatch, state_batch


class StateRunner:
    """``ModelRunner``'s part for linear-attention layers, mixed in ahead of it. Each layer
    with ``state_shapes()`` gets ``conv_states`` and ``recurrent_states`` pools of
    ``max_num_seqs + 1`` slots (the last, ``spare``, takes warm-up and padding rows). On a GPU
    each step's sequences also go to the device once (``StateBatch.tensors``); decode graphs read
    ``decode_rows`` [4, max_num_seqs] (starts, lens, slots, fresh), written before each replay."""

    def make_model(self, config):
        model = super().make_model(config)
        slots = config.max_num_seqs + 1
        self.spare = config.max_num_seqs
        self.state_layers = [m for m in model.modules() if hasattr(m, "state_shapes")]
        for layer in self.state_layers:
            conv, recurrent = layer.state_shapes()
            layer.conv_states = torch.zeros(slots, *conv, dtype=self.dtype, device=self.device)
            kind = {"dtype": torch.float32, "device": self.device}
            layer.recurrent_states = torch.zeros(slots, *recurrent, **kind)
        rows = np.zeros((4, config.max_num_seqs), dtype=np.int32)
        rows[0], rows[1], rows[2], rows[3] = np.arange(config.max_num_seqs), 1, self.spare, 1
        self.decode_rows = torch.from_numpy(rows).to(self.device)  # one token per sequence
        return model

    def capture_graphs(self, largest_only: bool = False):
        if self.device.type != "cuda":
            return None
        with state_batch(StateBatch(tensors=self.decode_rows, max_len=1)):
            return super().capture_graphs(largest_only)

    def run(self, step: Step):
        n = step.num_seqs
        lens = list(step.num_new) if step.is_prefill else [1] * n
        starts = [0, *accumulate(lens)][:-1]
        fresh = [k == 0 for k in step.num_computed]
        slots = [s if s >= 0 else self.spare for s in step.state_slots or [-1] * n]
        batch = StateBatch(starts, lens, slots, fresh)
        if self.device.type == "cuda":
            self._send(step, batch)
        with state_batch(batch):
            return super().run(step)

    def _send(self, step: Step, batch: StateBatch) -> None:
        """The step's rows to the device: a graphed decode step into ``decode_rows`` (padding on
        the spare slot, fresh), any other step as a new tensor."""
        n, rows = step.num_seqs, (batch.starts, batch.lens, batch.slots, batch.fresh)
        graphed = not step.is_prefill and self.graphs is not None
        padded = self.graphs.padded_batch(n) if graphed else None
        batch.max_len = max(batch.lens, default=0)
        if padded is not None:
            host = np.full((2, padded), [[self.spare], [1]], dtype=np.int32)
            host[:, :n] = (batch.slots, batch.fresh)
            self.decode_rows[2:, :padded].copy_(self._tensor(host, torch.int32))
            batch.tensors = self.decode_rows
            return
        batch.tensors = self._tensor(np.array(rows, dtype=np.int32).reshape(4, n), torch.int32)
        if step.is_prefill:
            cu = np.array([0, *accumulate(batch.lens)], dtype=np.int64)
            batch.cu_seqlens_cpu = torch.from_numpy(cu)
            batch.cu_seqlens = self._tensor(cu, torch.int64)
