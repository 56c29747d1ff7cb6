"""The model runner of a hybrid model: per-sequence recurrent states of its linear-attention
layers, in slots the block manager hands out (``Step.state_slots``)."""

from itertools import accumulate

import torch

from nanovllm.engine.step import Step
from nanovllm.layers.linear_attention.states import StateBatch, state_batch


class StateRunner:
    """``ModelRunner``'s part for linear-attention layers, mixed in ahead of it. Each layer
    with ``state_shapes()`` gets ``conv_states`` and ``recurrent_states`` pools of
    ``max_num_seqs + 1`` slots; decode runs eagerly (no CUDA graphs yet)."""

    def make_model(self, config):
        model = super().make_model(config)
        slots = config.max_num_seqs + 1
        self.state_layers = [m for m in model.modules() if hasattr(m, "state_shapes")]
        for layer in self.state_layers:
            conv, recurrent = layer.state_shapes()
            layer.conv_states = torch.zeros(slots, *conv, dtype=self.dtype, device=self.device)
            kind = {"dtype": torch.float32, "device": self.device}
            layer.recurrent_states = torch.zeros(slots, *recurrent, **kind)
        return model

    def capture_graphs(self, largest_only: bool = False):
        return None

    def run(self, step: Step):
        lens = step.num_new if step.is_prefill else [1] * step.num_seqs
        starts = [0, *accumulate(lens)][:-1]
        fresh = [n == 0 for n in step.num_computed]
        slots = step.state_slots or [-1] * step.num_seqs
        with state_batch(StateBatch(starts, list(lens), list(slots), fresh)):
            return super().run(step)
