"""LoRA on the linear layers: a target keeps its own method and adds each row's adapter."""

import torch
from torch import nn

from nanovllm.lora.batch import AdapterBatch, lora_linear

# a fused layer's slices, in the order of its shard ids; a checkpoint module -> (layer, slice)
SLICES = {"qkv_proj": ("q", "k", "v"), "o_proj": (None,), "gate_up_proj": (0, 1)}
SLICES["down_proj"] = (None,)
MODULE_SLICE = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
MODULE_SLICE |= {"o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0)}
MODULE_SLICE |= {"up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}


class LoRAMethod:
    """``base``'s GEMM, then ``y[t] += (x[t] A_s^T) B_s^T`` for the rows of each slot ``s``.
    The layer holds ``lora_a [slots, S*r, in]`` and ``lora_b [slots, out, S*r]``: slice ``j`` of
    ``S`` owns columns ``j*r:(j+1)*r`` (B is block-diagonal), ``r`` = max_lora_rank. The weight
    and ``lora_a`` are views of one buffer, ``lora_ext = [weight; lora_a]`` (one GEMM on a GPU)."""

    def __init__(self, base, batch: AdapterBatch):
        self.base, self.batch = base, batch

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None):
        if not self.batch.active:
            return self.base.apply(layer, x, bias)
        return lora_linear(layer, x, bias, self.base, self.batch)

    def missing(self, layer: nn.Module) -> list[str]:
        return self.base.missing(layer)


def wrap_model(model: nn.Module, max_loras: int, max_rank: int, batch: AdapterBatch) -> dict:
    """Give every attention and dense MLP projection its slots; ``{(layer, name): module}``
    (a hybrid model's linear-attention layers have none)."""
    layers = {}
    for i, decoder in enumerate(model.model.layers):
        for part in (getattr(decoder, "self_attn", None), decoder.mlp):
            for name, slices in SLICES.items():
                layer = getattr(part, name, None)
                if layer is None:
                    continue
                n_out, n_in = layer.weight.shape
                kind = {"dtype": layer.weight.dtype, "device": layer.weight.device}
                width = len(slices) * max_rank
                ext = torch.zeros(n_out + max_loras * width, n_in, **kind)
                ext[:n_out].copy_(layer.weight.data)
                layer.weight.data = ext[:n_out]  # the weight's own storage is freed
                layer.register_buffer("lora_ext", ext, persistent=False)
                a = ext[n_out:].view(max_loras, width, n_in)
                layer.register_buffer("lora_a", a, persistent=False)
                b = torch.zeros(max_loras, n_out, width, **kind)
                layer.register_buffer("lora_b", b, persistent=False)
                layer.quant_method = LoRAMethod(layer.quant_method, batch)
                layer.leaves_ranges = False  # the adapters' products are added to its output
                layers[(i, name)] = layer
    return layers


def load_slot(layers: dict, slot: int, weights: dict, max_rank: int) -> None:
    """An adapter's ``{(layer, module): (A, B)}`` into ``slot``, this rank's shard of each."""
    for layer in layers.values():
        layer.lora_a[slot].zero_()
        layer.lora_b[slot].zero_()
    for (i, module), (a, b) in weights.items():
        name, j = MODULE_SLICE[module]
        layer, col, r = layers[(i, name)], j * max_rank, a.shape[0]
        if layer.tp_dim == 1:  # row-parallel: each rank's partial sum adds its part of A
            _, src, size = layer.shard(layer.weight)
            a, dst, size, src = a[:, src : src + size], 0, b.shape[0], 0
        else:
            dst, src, size = layer.shard(layer.weight, SLICES[name][j])
        layer.lora_a[slot, col : col + r].copy_(a)
        layer.lora_b[slot, dst : dst + size, col : col + r].copy_(b[src : src + size])
