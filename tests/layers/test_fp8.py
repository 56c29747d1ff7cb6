"""The FP8 block arithmetic (``layers/quantization/fp8.py``) against exact expected values, and
the W8A8 products (dense and MoE) against float64 sums written out here."""

import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers.moe.fused_fp8 import fused_moe_torch_fp8
from nanovllm.quantization.fp8 import (
    dequantize_weight_blocks,
    fp8_linear,
    quantize_activation_groups,
    quantize_weight_blocks,
)

E4M3 = torch.float8_e4m3fn


def test_weight_scales_are_block_absmax_over_448_and_zero_blocks_get_1():
    w = torch.zeros(256, 300)
    w[5, 7] = -896.0  # block (0, 0): absmax 896 -> scale 2
    w[130, 129] = 44.8  # block (1, 1): scale 0.1 (in float32)
    w[255, 299] = 1.0  # block (1, 2), a partial block of 44 columns: scale 1/448
    q, scale = quantize_weight_blocks(w)
    assert q.dtype == E4M3 and q.shape == (256, 300)
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)
    expected = torch.tensor(
        [[2.0, 1.0, 1.0], [1.0, torch.tensor(44.8) / 448, torch.tensor(1.0) / 448]]
    )
    assert torch.equal(scale, expected)
    assert q[5, 7].item() == -448.0 and q[130, 129].item() == 448.0 and q[255, 299].item() == 448.0
    assert torch.count_nonzero(q.float()) == 3  # zero blocks (scale 1) stay zero


def test_values_round_to_nearest_even_e4m3():
    w = torch.zeros(1, 8)
    # scale 1 (absmax 448); e4m3 steps: 2 in [16, 32), 16 in [128, 256)
    w[0] = torch.tensor([448.0, 17.0, 19.0, -17.0, 248.0, 232.0, 0.06640625, 0.1])
    q, scale = quantize_weight_blocks(w)
    assert scale.item() == 1.0
    assert q.float()[0].tolist() == [448.0, 16.0, 20.0, -16.0, 256.0, 224.0, 0.0625, 0.1015625]


def test_values_are_clamped_to_448():
    v = 912.7556762695312  # v / (v / 448) is 448.00003 in float32
    q, scale = quantize_weight_blocks(torch.tensor([[v, -v / 2]]))
    assert scale.item() == torch.tensor(v) / 448
    assert q.float().tolist() == [[448.0, -224.0]]
    xq, xs = quantize_activation_groups(torch.tensor([[v, 1.0]]))
    assert xq.float()[0, 0].item() == 448.0 and xs.item() == torch.tensor(v) / 448


def test_activation_scales_per_token_and_group_of_128():
    x = torch.zeros(2, 200)
    x[0, 3], x[0, 150] = 4.48, -896.0
    x[1, 199] = 0.5  # token 1's first group is all zero
    q, scale = quantize_activation_groups(x)
    assert q.shape == (2, 200) and scale.shape == (2, 2)
    assert torch.equal(scale, torch.tensor([[torch.tensor(4.48) / 448, 2.0], [1.0, 0.5 / 448]]))
    assert (
        q.float()[0, 3].item() == 448.0
        and q.float()[0, 150].item() == -448.0
        and q.float()[1, 199].item() == 448.0
    )
    # leading dims and batched weights: [experts, out, in]
    w = torch.randn(3, 130, 260)
    qb, sb = quantize_weight_blocks(w)
    assert sb.shape == (3, 2, 3) and torch.equal(
        qb[1].float(), quantize_weight_blocks(w[1])[0].float()
    )


def _float64_w8a8(x, wq, ws):
    """sum over k-blocks of (e4m3 products summed) * activation scale * weight scale, in float64."""
    xq, xs = quantize_activation_groups(x)
    out = torch.zeros(x.shape[0], wq.shape[0], dtype=torch.float64)
    for kb in range(-(-x.shape[1] // 128)):
        cols = slice(kb * 128, (kb + 1) * 128)
        partial = xq[:, cols].double() @ wq[:, cols].double().T
        out += (
            partial
            * xs[:, kb, None].double()
            * ws.double().repeat_interleave(128, 0)[: wq.shape[0], kb][None]
        )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_blockwise_w8a8_sum(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 384, generator=g).to(dtype)
    wq, ws = quantize_weight_blocks(torch.randn(300, 384, generator=g) * 0.05)
    bias = torch.randn(300, generator=g).to(dtype)
    y = fp8_linear(x, wq, ws, bias)
    assert y.dtype == dtype
    expected = _float64_w8a8(x, wq, ws).float().to(dtype) + bias
    torch.testing.assert_close(
        y, expected, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5
    )
    # the activation quantization matters: the float product of x and the dequantized weight differs
    plain = F.linear(x.float(), dequantize_weight_blocks(wq, ws))
    assert (plain - _float64_w8a8(x, wq, ws).float()).abs().max() > 1e-3


def test_fused_moe_fp8_against_each_pair():
    g = torch.Generator().manual_seed(1)
    experts, inter, hidden, top_k = 4, 128, 256, 2
    w13, s13 = quantize_weight_blocks(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1)
    w2, s2 = quantize_weight_blocks(torch.randn(experts, hidden, inter, generator=g) * 0.1)
    x = torch.randn(6, hidden, generator=g)
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [2, 2], [0, 3], [1, 0]])
    weights = torch.rand(6, top_k, generator=g)
    out = fused_moe_torch_fp8(x, w13, s13, w2, s2, weights, ids)
    for t in range(6):
        expected = torch.zeros(hidden, dtype=torch.float64)
        for k in range(top_k):
            e = ids[t, k]
            gu = _float64_w8a8(x[t : t + 1], w13[e], s13[e])[0]
            h = (F.silu(gu[:inter]) * gu[inter:]).float()
            expected += weights[t, k].double() * _float64_w8a8(h[None], w2[e], s2[e])[0]
        torch.testing.assert_close(out[t], expected.float(), rtol=1e-4, atol=1e-5)
