"""The Mixture-of-Experts feed-forward with FP8 expert weights (128x128 blocks, float32 scales):
the torch reference and the CPU path, the W8A8 arithmetic of ``quantization/fp8.py`` applied to
each expert's gate/up and down projections.

For every token t and each of its top_k experts e: ``g, u = fp8_linear(x[t], w13[e])`` (float32),
``h = silu(g) * u`` held in x's dtype (as the Triton bf16 path holds its intermediate), then
``out[t] += topk_weights[t, k] * fp8_linear(h, w2[e])`` in float32; the sum is cast to x's dtype
at the end. ``fp8_linear``'s activation quantization (per token, per 128 channels) applies to x
and to h. Synchronises with the device (one expert at a time), so it is not for CUDA graphs.
"""
import torch
import torch.nn.functional as F

from nanovllm.layers.moe.fused import pairs_by_expert
from nanovllm.layers.quantization.fp8 import FP8_DTYPE, fp8_linear


def fused_moe_torch_fp8(hidden_states, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids) -> torch.Tensor:
    """``w13`` [experts, 2 * inter, hidden] and ``w2`` [experts, hidden, inter] float8_e4m3fn with
    their block scales ``w13_scale`` [experts, 2 * inter / 128, ceil(hidden / 128)] and ``w2_scale``
    [experts, ceil(hidden / 128), inter / 128] -> [num_tokens, hidden] in hidden_states' dtype."""
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"w13 and w2 must be {FP8_DTYPE}, got {w13.dtype} and {w2.dtype}")
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for expert, tokens, weights in pairs_by_expert(topk_ids, topk_weights):
        gate_up = fp8_linear(hidden_states[tokens], w13[expert], w13_scale[expert], out_dtype=torch.float32)
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden_states.dtype)
        down = fp8_linear(h, w2[expert], w2_scale[expert], out_dtype=torch.float32)  # [pairs, hidden]
        out.index_add_(0, tokens, down * weights)
    return out.to(hidden_states.dtype)
