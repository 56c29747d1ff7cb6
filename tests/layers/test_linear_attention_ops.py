"""Gated DeltaNet ops (nanovllm/layers/linear_attention/ops.py) against transformers' Qwen3.5
reference functions, float32: whole sequences, the same sequence in uneven pieces with the states
carried (chunked prefill, then decode), fresh states, the one-token step, the gated norm, the decay
and beta, and one whole layer."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

from nanovllm.layers.linear_attention.ops import (
    causal_conv,
    decay_and_beta,
    gated_delta_rule,
    gated_rms_norm,
)

HK, HV, DK, DV, C, W = 2, 4, 16, 32, 64, 4
PIECES = [1, 3, 64, 65, 2, 1, 40, 1, 1, 23]  # sums to 201: across chunks, below the conv window
ATOL = 2e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _delta_inputs(t: int, seed: int = 0):
    gen = _gen(seed)
    q, k = (torch.randn(t, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(t, HV, DV, generator=gen)
    a, b = torch.randn(t, HV, generator=gen), torch.randn(t, HV, generator=gen)
    a_log = torch.empty(HV).uniform_(0.01, 4, generator=gen).log()
    g, beta = decay_and_beta(a, b, a_log, torch.rand(HV, generator=gen))
    return q, k, v, g, beta


def _ref_chunk(q, k, v, g, beta, state=None):
    out, final = ref.torch_chunk_gated_delta_rule(
        *(x[None] for x in (q, k, v, g, beta)),
        initial_state=None if state is None else state[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0]


def _conv_ref(x, weight):
    return ref.causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()


def test_whole_sequence_matches_reference():
    gen = _gen(1)
    x, weight = torch.randn(201, C, generator=gen), torch.randn(C, W, generator=gen)
    state = torch.full((C, W - 1), float("nan"))
    out = causal_conv(x, weight, state, fresh=True)
    torch.testing.assert_close(out, _conv_ref(x, weight), atol=ATOL, rtol=0)
    assert torch.equal(state, x[-(W - 1) :].t())
    q, k, v, g, beta = _delta_inputs(201)
    s = torch.full((HV, DK, DV), float("nan"))
    out = gated_delta_rule(q, k, v, g, beta, s, fresh=True)
    want, want_state = _ref_chunk(q, k, v, g, beta)
    assert out.shape == (201, HV, DV) and out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(s, want_state, atol=ATOL, rtol=0)


def test_short_sequences_and_a_small_chunk_size():
    gen = _gen(2)
    x, weight = torch.randn(2, C, generator=gen), torch.randn(C, W, generator=gen)
    out = causal_conv(x, weight, torch.zeros(C, W - 1), fresh=True)
    torch.testing.assert_close(out, _conv_ref(x, weight), atol=ATOL, rtol=0)
    q, k, v, g, beta = _delta_inputs(50, seed=3)
    want, want_state = _ref_chunk(q, k, v, g, beta)
    for t, chunk in [(2, 64), (50, 7), (50, 16), (50, 50)]:
        s = torch.zeros(HV, DK, DV)
        out = gated_delta_rule(q[:t], k[:t], v[:t], g[:t], beta[:t], s, False, chunk_size=chunk)
        torch.testing.assert_close(out, want[:t], atol=ATOL, rtol=0)
        if t == 50:
            torch.testing.assert_close(s, want_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk_size", [64, 16])
def test_pieces_with_carried_states_equal_the_whole(chunk_size):
    t = sum(PIECES)
    gen = _gen(4)
    x, weight = torch.randn(t, C, generator=gen), torch.randn(C, W, generator=gen)
    q, k, v, g, beta = _delta_inputs(t, seed=5)
    conv_state = torch.full((C, W - 1), 7.0)
    s = torch.full((HV, DK, DV), 7.0)
    conv_outs, outs, start = [], [], 0
    for i, n in enumerate(PIECES):
        sl = slice(start, start + n)
        conv_outs.append(causal_conv(x[sl], weight, conv_state, fresh=i == 0))
        outs.append(gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], s, i == 0, chunk_size))
        start += n
    torch.testing.assert_close(torch.cat(conv_outs), _conv_ref(x, weight), atol=ATOL, rtol=0)
    want, want_state = _ref_chunk(q, k, v, g, beta)
    torch.testing.assert_close(torch.cat(outs), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(s, want_state, atol=ATOL, rtol=0)
    assert torch.equal(conv_state, x[-(W - 1) :].t())


@pytest.mark.parametrize("t", [1, 5, 70])
def test_fresh_ignores_garbage_in_the_states(t):
    gen = _gen(6)
    x, weight = torch.randn(t, C, generator=gen), torch.randn(C, W, generator=gen)
    q, k, v, g, beta = _delta_inputs(t, seed=7)
    results = []
    for fill in (0.0, float("nan"), 1e30):
        cs, s = torch.full((C, W - 1), fill), torch.full((HV, DK, DV), fill)
        results.append(
            (causal_conv(x, weight, cs, True), cs, gated_delta_rule(q, k, v, g, beta, s, True), s)
        )
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            assert torch.equal(got, want)
    assert not results[0][3].isnan().any()
    torch.testing.assert_close(results[0][2], _ref_chunk(q, k, v, g, beta)[0], atol=ATOL, rtol=0)


def test_one_token_matches_the_recurrent_reference():
    q, k, v, g, beta = _delta_inputs(1, seed=8)
    init = torch.randn(HV, DK, DV, generator=_gen(9))
    s = init.clone()
    out = gated_delta_rule(q, k, v, g, beta, s, fresh=False)
    want, want_state = ref.torch_recurrent_gated_delta_rule(
        *(x[None] for x in (q, k, v, g, beta)),
        initial_state=init[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out, want[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(s, want_state[0], atol=ATOL, rtol=0)
    # the conv's one-row update against the reference's decode step, state included
    gen = _gen(10)
    x, weight = torch.randn(1, C, generator=gen), torch.randn(C, W, generator=gen)
    cs = torch.randn(C, W - 1, generator=gen)
    ref_cs = cs.clone()[None]
    want = ref.causal_conv1d_update(x.t()[None], ref_cs, weight, activation="silu")[0].t()
    torch.testing.assert_close(causal_conv(x, weight, cs, fresh=False), want, atol=ATOL, rtol=0)
    assert torch.equal(cs, ref_cs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_the_reference(dtype):
    gen = _gen(11)
    x, gate = (torch.randn(12, DV, generator=gen).to(dtype) for _ in range(2))
    norm = ref.Qwen3_5RMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(DV, generator=gen))
    norm = norm.to(dtype)
    got = gated_rms_norm(x, gate, norm.weight.detach(), 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, norm(x, gate).detach(), atol=1e-6, rtol=0)


def test_decay_and_beta_match_the_reference():
    gen = _gen(12)
    a, b = torch.randn(9, HV, generator=gen) * 4, torch.randn(9, HV, generator=gen) * 4
    a_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    g, beta = decay_and_beta(a.bfloat16(), b, a_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and (g <= 0).all()
    torch.testing.assert_close(g, -a_log.exp() * F.softplus(a.bfloat16().float() + dt_bias))
    torch.testing.assert_close(beta, b.sigmoid())


def test_one_layer_matches_qwen3_5_gated_deltanet():
    """The ops composed as the layer does, on the reference layer's own weights."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        hidden_size=48, linear_num_key_heads=HK, linear_num_value_heads=HV,
        linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=W,
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
    )  # fmt: skip
    torch.manual_seed(13)
    layer = ref.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    t = 90
    h = torch.randn(t, 48, generator=_gen(14))
    with torch.no_grad():
        want = layer(h[None])[0]
        conv_w = layer.conv1d.weight[:, 0]
        conv_state = torch.zeros(conv_w.shape[0], W - 1)
        s, outs = torch.zeros(HV, DK, DV), []
        for sl in (slice(0, 70), slice(70, 71), slice(71, 90)):
            x = h[sl]
            mixed = causal_conv(layer.in_proj_qkv(x), conv_w, conv_state, sl.start == 0)
            q, k, val = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
            g, beta = decay_and_beta(
                layer.in_proj_a(x), layer.in_proj_b(x), layer.A_log, layer.dt_bias
            )
            n = x.shape[0]
            o = gated_delta_rule(q.reshape(n, HK, DK), k.reshape(n, HK, DK),
                                 val.reshape(n, HV, DV), g, beta, s, sl.start == 0)  # fmt: skip
            z = layer.in_proj_z(x).reshape(n * HV, DV)
            o = gated_rms_norm(o.reshape(n * HV, DV), z, layer.norm.weight, 1e-6)
            outs.append(layer.out_proj(o.reshape(n, HV * DV)))
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-4, rtol=1e-4)
