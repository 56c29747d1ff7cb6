"""The model runner with LoRA adapters (``Config.lora_config``)."""

import numpy as np

from nanovllm.engine.step import Step
from nanovllm.lora.batch import AdapterBatch
from nanovllm.lora.layers import load_slot, wrap_model


class LoRARunner:
    """``ModelRunner``'s LoRA part, mixed in ahead of it. Adapters live in ``max_loras`` slots of
    every target layer; ``Step.adapters`` names each sequence's slot (-1: the base model), the
    same on every rank."""

    def make_model(self, config):
        if config.weight_quantization is not None:
            from nanovllm.entrypoints.options import FP8_AND_LORA

            raise ValueError(FP8_AND_LORA)
        model = super().make_model(config)
        lc = config.lora_config
        max_rows = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.adapters = AdapterBatch(lc.max_loras, max_rows, self.device)
        self.lora_layers = wrap_model(model, lc.max_loras, lc.max_lora_rank, self.adapters)
        return model

    def capture_graphs(self, largest_only: bool = False):
        self.adapters.active = False  # the base graphs hold no LoRA kernel (nor a stale table)
        base = super().capture_graphs(largest_only)
        self.adapters.capturing()
        try:
            return GraphPair(base, super().capture_graphs(largest_only))
        finally:
            self.adapters.active = False

    def run(self, step: Step):
        lora = step.adapters is not None and max(step.adapters) >= 0
        padded = None
        if lora and not step.is_prefill and self.graphs is not None:
            padded = self.graphs.padded_batch(step.num_seqs)
        graphed = padded is not None
        if lora:
            slots = np.array(step.adapters)
            rows = np.repeat(slots, step.num_new) if step.is_prefill else slots
            self.adapters.set_rows(rows, padded or len(rows), graphed)
        else:
            self.adapters.active = False  # the base model's rows only
        if self.graphs is not None:
            self.graphs.lora = graphed
        return super().run(step)

    def load_lora(self, slot: int, weights: dict) -> None:
        """An adapter's weights into ``slot`` (every rank, between steps)."""
        load_slot(self.lora_layers, slot, weights, self.config.lora_config.max_lora_rank)


class GraphPair:
    """Decode graphs of the base model, and with the LoRA kernels (``lora``: replay those)."""

    def __init__(self, base, with_lora):
        self.base, self.with_lora, self.lora = base, with_lora, False

    def padded_batch(self, n: int) -> int | None:
        return self.base.padded_batch(n)

    def replay(self, n: int, batch: int, turn: int):
        return (self.with_lora if self.lora else self.base).replay(n, batch, turn)

    def output(self, n: int, turn: int, wait):
        return (self.with_lora if self.lora else self.base).output(n, turn, wait)
