"""A GatedDeltaNet layer's mixing over a whole step on a GPU: the Triton conv, the delta rule
(flash-linear-attention's chunked kernel for prefill when ``fla`` imports, else the recurrent
Triton kernel), the gated norm. ``NANOVLLM_GDN_FLA=0`` keeps fla out."""

import os
from functools import cache

import torch
import triton
import triton.language as tl

from nanovllm.layers.linear_attention.triton_ops import causal_conv_varlen, delta_rule_varlen

FLA_MIN_LEN = 16  # prefill steps whose longest sequence is shorter stay on the recurrent kernel
# fla's chunked dots run in bf16 / tf32: a float32 model keeps the recurrent kernel (float32 exact)
FLA_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, w_ptr, out_ptr, N, D, eps,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    normed = (x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]).to(dtype)
    y = (w[None, :] * normed.to(tl.float32)).to(dtype).to(tl.float32)  # rounded as ops.py does
    tl.store(out_ptr + offs, (y * (z / (1.0 + tl.exp(-z)))).to(dtype), mask=mask)


def gated_rms_norm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``ops.gated_rms_norm`` as one kernel: x, gate [N, D] contiguous, weight [D] -> [N, D]."""
    n, d = x.shape
    if gate.shape != (n, d) or weight.shape != (d,):
        shapes = f"x {list(x.shape)}, gate {list(gate.shape)}, weight {list(weight.shape)}"
        raise ValueError(f"{shapes}; allowed: gate as x, weight [D]")
    x, gate = x.contiguous(), gate.contiguous()
    out = torch.empty_like(x)
    block_d = triton.next_power_of_2(d)
    block_n = max(1, 2048 // block_d)
    if n:
        grid = (triton.cdiv(n, block_n),)
        _gated_rms_norm_kernel[grid](x, gate, weight, out, n, d, eps, block_n, block_d)
    return out


@cache
def fla_chunked():
    """flash-linear-attention's ``chunk_gated_delta_rule``, or None (not installed, or off)."""
    if os.environ.get("NANOVLLM_GDN_FLA", "1") == "0":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # any failure to import (missing, or built for another torch/triton)
        return None
    return chunk_gated_delta_rule


def delta_rule_chunked_fla(q, k, v, g, beta, states, batch) -> torch.Tensor:
    """The step's sequences through fla's chunked kernel (all rows covered, in order): each
    slot's state gathered (zero when fresh), the final states scattered back."""
    chunk = fla_chunked()
    _, _, slots, fresh = batch.tensors
    slots = slots.long()
    init = states.index_select(0, slots)
    init.masked_fill_(fresh.bool()[:, None, None, None], 0.0)
    out, final = chunk(
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=batch.cu_seqlens, cu_seqlens_cpu=batch.cu_seqlens_cpu,
    )  # fmt: skip
    states.index_copy_(0, slots, final.float())
    return out[0]


def use_fla(batch, dtype: torch.dtype) -> bool:
    long_prefill = batch.cu_seqlens is not None and batch.max_len >= FLA_MIN_LEN
    return long_prefill and dtype in FLA_DTYPES and fla_chunked() is not None


def mix_step(layer, mixed, z, a, b, batch) -> torch.Tensor:
    """``layer``'s conv, delta rule and gated norm over the step -> [T, Hv*Dv] for out_proj.
    ``batch.tensors`` [4, >= N] int32 rows starts, lens, slots, fresh; ``batch.max_len``. N is
    the host lists' length, or without them (a captured decode step) one sequence per row."""
    t = mixed.shape[0]
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    starts, lens, slots, fresh = batch.tensors[:, : len(batch.starts) or t]
    weight = layer.conv1d.weight[:, 0]
    x = causal_conv_varlen(
        mixed, weight, layer.conv_states, starts, lens, slots, fresh, batch.max_len
    )
    q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv)
    states = layer.recurrent_states
    if use_fla(batch, mixed.dtype):
        from nanovllm.layers.linear_attention.ops import decay_and_beta

        g, beta = decay_and_beta(a, b, layer.A_log, layer.dt_bias)
        out = delta_rule_chunked_fla(q, k, v, g, beta, states, batch)
    else:
        gate = (layer.A_log, layer.dt_bias)
        out = delta_rule_varlen(q, k, v, a, b, states, starts, lens, slots, fresh, gate=gate)
    o = gated_rms_norm_triton(out.reshape(t * hv, dv), z.reshape(t * hv, dv), layer.norm.weight,
                              layer.eps)  # fmt: skip
    return o.reshape(t, hv * dv)
