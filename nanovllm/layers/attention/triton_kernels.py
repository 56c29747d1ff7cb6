"""Steps shared by the Triton attention kernels; docs/attention.md explains the FP8 arithmetic."""

import os

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# running max before any key is seen: finite, so exp2(MASKED - MASKED) is 1, not NaN
MASKED = tl.constexpr(-1.0e30)
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")  # no inline PTX there


@triton.jit
def _dot(a, b):
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")  # not TF32
    return tl.dot(a, b)


@triton.jit
def _e4m3_tile(v, DOT_DTYPE: tl.constexpr):
    if DOT_DTYPE == tl.float16 and not INTERPRETED:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r",
            [v],
            dtype=tl.float16,
            is_pure=False,
            pack=4,
        )
    return v.to(DOT_DTYPE)


@triton.jit
def _online_softmax_step(qk, v, v_scale, m_i, l_i, acc, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:  # the V scales weight the output, not the running sum
        w = p * v_scale[None, :]
        w_max = tl.max(w, 1)
        w_max = tl.where(w_max == 0.0, 1.0, w_max)
        pv = _dot((w / w_max[:, None]).to(DOT_DTYPE), _e4m3_tile(v, DOT_DTYPE))
        acc = acc * alpha[:, None] + pv * w_max[:, None]
    else:
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _fp8_query(q, qk_scale, DOT_DTYPE: tl.constexpr):
    """q / 2^e per row, in (-2, 2), and the row factor 2^e * qk_scale for its scores."""
    q = q.to(tl.float32)
    q_max = tl.max(tl.abs(q), 1)
    power = (q_max.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    power = tl.where(power == 0.0, 1.0, power)  # an all-zero (or subnormal) row
    return (q / power[:, None]).to(DOT_DTYPE), power * qk_scale


@triton.jit
def _fp8_scores(q, row_scale, k, k_scale_ptrs, v_scale_ptrs, kv_mask, DOT_DTYPE: tl.constexpr):
    k_scale = tl.load(k_scale_ptrs, mask=kv_mask, other=0.0)
    v_scale = tl.load(v_scale_ptrs, mask=kv_mask, other=0.0)
    return _dot(q, k.to(DOT_DTYPE)) * row_scale[:, None] * k_scale[None, :], v_scale
