"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) in plain torch, one sequence at a time.

The engine runs sequences of different lengths in one step; each call here takes one sequence's new
rows and its states (conv window, recurrent matrix), which carry between steps and are updated in
place. Math is float32; results come back in the input dtype.
"""

import torch
import torch.nn.functional as F

L2_EPS = 1e-6


def _check(name: str, t: torch.Tensor, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} has shape {list(t.shape)}; allowed: {want}")


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, fresh: bool
) -> torch.Tensor:
    """silu(depthwise causal conv) of one sequence's new rows ``x`` [T, C] -> [T, C].

    ``weight`` [C, W]; ``state`` [C, W-1] holds the W-1 inputs before ``x`` (zeros used instead
    when ``fresh``) and is overwritten with the last W-1 inputs including ``x``.
    """
    _check("x", x, (None, None))
    t, c = x.shape
    _check("weight", weight, (c, None))
    w = weight.shape[1]
    if w < 1:
        raise ValueError(f"weight has kernel size {w}; allowed: >= 1")
    _check("state", state, (c, w - 1))
    if t == 0:
        raise ValueError("x has 0 rows; allowed: at least 1")
    if fresh:
        prev = torch.zeros(c, w - 1, dtype=torch.float32, device=x.device)
    else:
        prev = state.float()
    full = torch.cat([prev, x.float().t()], dim=1)  # [C, W-1+T]
    out = F.conv1d(full.unsqueeze(0), weight.float().unsqueeze(1), groups=c)[0]  # [C, T]
    if w > 1:
        state.copy_(full[:, -(w - 1) :])
    return F.silu(out).t().to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _check_delta_inputs(q, k, v, g, beta, state) -> None:
    _check("k", k, (None, None, None))
    t, hk, dk = k.shape
    _check("q", q, (t, hk, dk))
    _check("v", v, (t, None, None))
    hv, dv = v.shape[1:]
    if t == 0:
        raise ValueError("q, k, v have 0 tokens; allowed: at least 1")
    if hk == 0 or hv % hk:
        raise ValueError(f"v has {hv} heads for k's {hk}; allowed: a multiple of k's heads")
    _check("g", g, (t, hv))
    _check("beta", beta, (t, hv))
    _check("state", state, (hv, dk, dv))
    if state.dtype != torch.float32:
        raise TypeError(f"state has dtype {state.dtype}; allowed: torch.float32")


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    fresh: bool,
    chunk_size: int = 64,
) -> torch.Tensor:
    """One sequence's new tokens through the gated delta rule -> output [T, Hv, Dv] (q's dtype).

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log decay, <= 0) and beta [T, Hv]; each k head serves
    Hv/Hk consecutive value heads. q and k are l2-normalised, q scaled by Dk**-0.5. ``state``
    [Hv, Dk, Dv] float32 (zeros used instead when ``fresh``) is updated in place. T == 1 takes the
    one-step recurrence, longer inputs the chunked form.
    """
    _check_delta_inputs(q, k, v, g, beta, state)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size is {chunk_size!r}; allowed: an int >= 1")
    t, hk, dk = k.shape
    hv = v.shape[1]
    rep = hv // hk
    # heads first, float32: [H, T, D] and [H, T]
    qf = _l2norm(q.float()).repeat_interleave(rep, dim=1).transpose(0, 1) * dk**-0.5
    kf = _l2norm(k.float()).repeat_interleave(rep, dim=1).transpose(0, 1)
    vf = v.float().transpose(0, 1)
    gf, bf = g.float().t(), beta.float().t()
    s = torch.zeros_like(state) if fresh else state.clone()
    if t == 1:
        out = _recurrent_step(qf[:, 0], kf[:, 0], vf[:, 0], gf[:, 0], bf[:, 0], s)[:, None]
    else:
        out = _chunked(qf, kf, vf, gf, bf, s, min(chunk_size, t))
    state.copy_(s)
    return out.transpose(0, 1).to(q.dtype)


def _recurrent_step(q, k, v, g, beta, s):
    """One token per head: q, k [H, Dk]; v [H, Dv]; g, beta [H]; s [H, Dk, Dv] updated in place."""
    s.mul_(g.exp()[:, None, None])
    pred = torch.einsum("hk,hkv->hv", k, s)
    delta = (v - pred) * beta[:, None]
    s.add_(k[:, :, None] * delta[:, None, :])
    return torch.einsum("hk,hkv->hv", q, s)


def _chunked(q, k, v, g, beta, s, size):
    """All tokens: q, k [H, T, Dk]; v [H, T, Dv]; g, beta [H, T]; s [H, Dk, Dv] updated in place.

    Within a chunk with state S0 and cumulative log decay c, the corrections u_t that the delta rule
    writes satisfy (I + A) u = beta*v - (beta*k*exp(c)) S0 with A[i, j] = beta_i (k_i . k_j)
    exp(c_i - c_j) for j < i; one triangular solve gives both parts. Padding tokens (beta = 0,
    g = 0, zero vectors) change nothing.
    """
    h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // size
    q, k, v = (x.reshape(h, n, size, x.shape[-1]) for x in (q, k, v))
    c = g.reshape(h, n, size).cumsum(-1)
    beta = beta.reshape(h, n, size, 1)
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # decay from j to i for j <= i; masked before exp so nothing overflows
    pair = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta
    a = (kb @ k.transpose(-1, -2)) * pair
    a = a.tril(-1) + torch.eye(size, dtype=a.dtype, device=a.device)
    rhs = torch.cat([v * beta, kb * c.exp()[..., None]], dim=-1)
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u0, w = sol[..., :dv], sol[..., dv:]
    qk = (q @ k.transpose(-1, -2)) * pair  # pair is zero above the diagonal
    q_dec = q * c.exp()[..., None]
    k_dec = k * (c[..., -1:] - c).exp()[..., None]
    last = c[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty(h, n, size, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        u = u0[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + qk[:, i] @ u
        s.mul_(last[:, i]).add_(k_dec[:, i].transpose(-1, -2) @ u)
    return out.reshape(h, n * size, dv)[:, :t]


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of ``x`` [N, D] in float32, times ``weight`` [D], times silu(``gate`` [N, D]).

    Rounds as Qwen3.5's gated norm: the normalised rows go back to x's dtype before the weight, the
    gate's silu is float32, the result is in x's dtype.
    """
    _check("x", x, (None, None))
    _check("gate", gate, tuple(x.shape))
    _check("weight", weight, (x.shape[1],))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def decay_and_beta(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) float32 [T, Hv] from the projections a, b [T, Hv] and per-head A_log, dt_bias [Hv]:
    g = -exp(A_log) * softplus(a + dt_bias) (log decay, <= 0), beta = sigmoid(b)."""
    _check("a", a, (None, None))
    _check("b", b, tuple(a.shape))
    _check("A_log", A_log, (a.shape[1],))
    _check("dt_bias", dt_bias, (a.shape[1],))
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()
