"""Gated DeltaNet on a GPU: Triton kernels over a whole step of sequences at once (varlen).

Every kernel takes the step's sequences as int32 device tensors ``starts``, ``lens``, ``slots``,
``fresh`` [N] (sequence ``i`` owns rows ``starts[i] : starts[i] + lens[i]`` and state slot
``slots[i]``; ``fresh[i] != 0``: its states start at zero). Nothing syncs with the host and the
launch shapes depend only on N, the rows and the longest sequence (one for decode), so a decode
step can be captured in a CUDA graph. The states are updated in place, as ``ops.py`` does them.
"""

import torch
import triton
import triton.language as tl

from nanovllm.layers.linear_attention.ops import L2_EPS


@triton.jit
def _causal_conv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    state_ptr,
    starts_ptr,
    lens_ptr,
    slots_ptr,
    fresh_ptr,
    C,
    stride_x,
    stride_out,
    stride_slot,
    W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    seq, tb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(lens_ptr + seq)
    if tb * BLOCK_T >= n:
        return
    start = tl.load(starts_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    keep = tl.load(fresh_ptr + seq) == 0  # the carried window is read (else zeros)
    lo = tl.where(keep, -(W - 1), 0)  # the first window row read (masks as ranges: the
    # interpreter takes no scalar booleans in a mask)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask, c_mask = offs_t < n, offs_c < C
    state = state_ptr + slot * stride_slot + offs_c * (W - 1)  # [C, W-1] per slot, oldest first
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        idx = offs_t - (W - 1) + j  # the input row within the sequence (< 0: the window)
        in_x = (t_mask & (idx >= 0))[:, None] & c_mask[None, :]
        rows = (start + idx.to(tl.int64))[:, None] * stride_x
        xv = tl.load(x_ptr + rows + offs_c[None, :], mask=in_x, other=0.0).to(tl.float32)
        if W > 1:
            in_s = (t_mask & (idx < 0) & (idx >= lo))[:, None] & c_mask[None, :]
            sv = tl.load(state[None, :] + (W - 1 + idx)[:, None], mask=in_s, other=0.0)
            xv += sv.to(tl.float32)
        wv = tl.load(w_ptr + offs_c * W + j, mask=c_mask, other=0.0).to(tl.float32)
        acc += xv * wv[None, :]
    out = acc / (1.0 + tl.exp(-acc))  # silu
    dst = out_ptr + (start + offs_t.to(tl.int64))[:, None] * stride_out + offs_c[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & c_mask[None, :])
    if W > 1:
        if tb == 0:  # the last W-1 inputs back into the window (column m from n-(W-1)+m)
            tl.debug_barrier()  # every read of the old window above is done
            for m in tl.static_range(W - 1):
                src = n - (W - 1) + m  # < 0: still in the old window, at column n + m > m
                x_mask = offs_c < tl.where(src >= 0, C, 0)
                cur = tl.load(x_ptr + (start + src) * stride_x + offs_c, mask=x_mask, other=0.0)
                old_mask = offs_c < tl.where((src < 0) & keep, C, 0)
                old = tl.load(state + n + m, mask=old_mask, other=0.0)
                new = tl.where(src >= 0, cur, old.to(cur.dtype))
                tl.store(state + m, new.to(state_ptr.dtype.element_ty), mask=c_mask)


def _check_batch(starts, lens, slots, fresh) -> int:
    n = starts.shape[0]
    for name, t in (("starts", starts), ("lens", lens), ("slots", slots), ("fresh", fresh)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != n or t.stride(0) != 1:
            msg = f"dtype {t.dtype}, shape {list(t.shape)}; allowed: contiguous int32 [{n}]"
            raise ValueError(f"{name} has {msg}")
    return n


def causal_conv_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """silu(depthwise causal conv) of every sequence's rows of ``x`` [T, C] -> [T, C] (x's dtype).

    ``weight`` [C, W]; ``conv_states`` [slots, C, W-1] (contiguous) hold each slot's last W-1
    inputs, oldest first, and get the new last W-1 (a sequence shorter than W-1 shifts its
    window). ``max_len`` >= every length (the grid). Rows no sequence covers are left as they are.
    """
    t, c = x.shape
    w = weight.shape[-1]
    n = _check_batch(starts, lens, slots, fresh)
    if weight.shape != (c, w) or not weight.is_contiguous():
        raise ValueError(f"weight has shape {list(weight.shape)}; allowed: contiguous [{c}, W]")
    if conv_states.shape[1:] != (c, w - 1) or not conv_states.is_contiguous():
        shape = list(conv_states.shape)
        raise ValueError(f"conv_states has shape {shape}; allowed: contiguous [S, {c}, {w - 1}]")
    if x.stride(1) != 1:
        raise ValueError(f"x has strides {x.stride()}; allowed: contiguous rows")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    block_t = max(triton.next_power_of_2(max(w - 1, 1)), min(32, triton.next_power_of_2(max_len)))
    block_c = 128
    grid = (n, triton.cdiv(max(max_len, 1), block_t), triton.cdiv(c, block_c))
    if n and t:
        _causal_conv_kernel[grid](
            x, weight, out, conv_states, starts, lens, slots, fresh,
            c, x.stride(0), out.stride(0), conv_states.stride(0),
            W=w, BLOCK_T=block_t, BLOCK_C=block_c,
        )  # fmt: skip
    return out


@triton.jit
def _softplus(x):
    e = tl.exp(x)
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))  # log1p(e), accurate for small e
    return tl.where(x > 20.0, x, log1p)  # torch's softplus threshold


@triton.jit
def _delta_rule_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    a_log_ptr,
    dt_bias_ptr,
    out_ptr,
    state_ptr,
    starts_ptr,
    lens_ptr,
    slots_ptr,
    fresh_ptr,
    stride_q,
    stride_k,
    stride_v,
    stride_g,
    stride_beta,
    stride_out,
    scale,
    eps,
    HV: tl.constexpr,
    REP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
):
    seq, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(lens_ptr + seq)
    start = tl.load(starts_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    keep = tl.load(fresh_ptr + seq) == 0
    hk = hv // REP
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    k_mask, v_mask = offs_k < DK, offs_v < DV
    s_mask = k_mask[:, None] & v_mask[None, :]
    read = (offs_k < tl.where(keep, DK, 0))[:, None] & v_mask[None, :]
    s_ptrs = state_ptr + (slot * HV + hv) * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(s_ptrs, mask=read, other=0.0)  # [BK, BV] float32, in registers
    if GATE:
        decay_rate = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    for i in range(n):
        row = start + i
        q = tl.load(q_ptr + row * stride_q + hk * DK + offs_k, mask=k_mask, other=0.0)
        k = tl.load(k_ptr + row * stride_k + hk * DK + offs_k, mask=k_mask, other=0.0)
        v = tl.load(v_ptr + row * stride_v + hv * DV + offs_v, mask=v_mask, other=0.0)
        g = tl.load(g_ptr + row * stride_g + hv).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_beta + hv).to(tl.float32)
        if GATE:  # g and beta hold the projections a and b
            g = decay_rate * _softplus(g + dt_bias)
            beta = 1.0 / (1.0 + tl.exp(-beta))
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + eps)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        dst = out_ptr + row * stride_out + hv * DV + offs_v
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=v_mask)
    if n > 0:
        tl.store(s_ptrs, s, mask=s_mask)


def _heads(name: str, t: torch.Tensor, rows: int) -> None:
    if t.dim() != 3 or t.shape[0] != rows or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(f"{name} has shape {list(t.shape)}, strides {t.stride()}; allowed: "
                         f"[{rows}, H, D] with contiguous heads (any row stride)")  # fmt: skip


def delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule, token by token, over every sequence -> out [T, Hv, Dv] (q's dtype).

    q, k [T, Hk, Dk]; v [T, Hv, Dv] (row strides free); g, beta [T, Hv] as ``ops.gated_delta_rule``
    takes them, or with ``gate=(A_log, dt_bias)`` the projections a, b from which
    ``ops.decay_and_beta`` makes them. ``states`` [slots, Hv, Dk, Dv] float32 contiguous, updated
    in place. Rows no sequence covers keep ``out``'s values (zeros if ``out`` is None).
    """
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    for name, x in (("q", q), ("k", k), ("v", v)):
        _heads(name, x, t)
    if q.shape != k.shape or hv % hk:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}; allowed: "
                         "q and k alike, v's heads a multiple of k's")  # fmt: skip
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (t, hv) or x.stride(1) != 1:
            raise ValueError(f"{name} has shape {list(x.shape)}; allowed: [{t}, {hv}]")
    if states.dtype != torch.float32 or states.shape[1:] != (hv, dk, dv):
        raise ValueError(f"states has {states.dtype} {list(states.shape)}; "
                         f"allowed: float32 [S, {hv}, {dk}, {dv}]")  # fmt: skip
    if not states.is_contiguous():
        raise ValueError("states is not contiguous; allowed: contiguous")
    n = _check_batch(starts, lens, slots, fresh)
    if out is None:
        out = q.new_zeros(t, hv, dv)
    a_log, dt_bias = gate if gate is not None else (g, g)
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 4096 // bk))  # a [Dk, BV] tile of <= 4K floats
    grid = (n, hv, triton.cdiv(dv, bv))
    if n and t:
        _delta_rule_kernel[grid](
            q, k, v, g, beta, a_log, dt_bias, out, states, starts, lens, slots, fresh,
            q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), out.stride(0),
            dk**-0.5, L2_EPS,
            HV=hv, REP=hv // hk, DK=dk, DV=dv, BK=bk, BV=bv, GATE=gate is not None,
        )  # fmt: skip
    return out
