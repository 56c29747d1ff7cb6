"""The norm and activation kernels that quantize their output for an FP8 linear (``fp8_fused.py``)
against the torch composition they replace (``rms_norm`` / ``add_rms_norm`` / ``silu_and_mul``, then
``quantize_activation_groups``), under the Triton interpreter (one subprocess: this file run as a
script): float32 and bf16, with and without the residual, row counts below and past the padding to
16, a width that is not a multiple of 128 (a narrower last group), an all-zero row.

The kernel sums the squares in another order than torch, so rstd may differ in the last float32
place, and a normalized value may then round to the neighbouring bf16 or e4m3 value: the test allows
one e4m3 step (2^-3 of a value) on at most 1% of the values and wants the scales within 1e-6 of
each other, the residual sums equal and the padding rows zero with scale 1. SiLU's exp is
the interpreter's (NumPy's), not torch's, with the same allowance.
"""

import pytest
import torch
from triton_interpreter import (
    results_under_interpreter,
    round_interpreter_casts_to_nearest,
    run_cases,
)

F32, BF16 = torch.float32, torch.bfloat16


def compare(rows, want, total=None, want_total=None) -> dict:
    m = want.rows
    got_q, want_q = rows.q[:m].float(), want.q.float()
    got_s, want_s = rows.scales[:, :m], want.scales
    got = got_q * got_s.T.repeat_interleave(128, dim=1)[:, : got_q.shape[1]]
    ref = want_q * want_s.T.repeat_interleave(128, dim=1)[:, : want_q.shape[1]]
    step = (got - ref).abs() > 2**-3 * ref.abs() + 1e-30
    padded = -(-m // 16) * 16
    return {
        "shapes": [list(rows.q.shape), list(rows.scales.shape), rows.rows, str(rows.dtype)],
        "want_shapes": [
            [padded, want.q.shape[1]],
            [want.scales.shape[0], padded],
            m,
            str(want.dtype),
        ],
        "q_equal_share": (got_q == want_q).float().mean().item() if m else 1.0,
        "beyond_one_step": int(step.sum()),
        "scale_rel_diff": ((got_s - want_s).abs() / want_s).max().item() if m else 0.0,
        "padding_ok": bool((rows.q[m:].float() == 0).all() and (rows.scales[:, m:] == 1).all()),
        "total_equal": None if total is None else bool(torch.equal(total, want_total)),
    }


def check_norm(m: int, n: int, dtype, residual: bool, zero_row: bool = False) -> dict:
    from nanovllm.layers.layernorm import add_rms_norm, rms_norm
    from nanovllm.quantization.fp8 import quantize_to_rows
    from nanovllm.quantization.fp8_fused import rms_norm_quantized_triton

    g = torch.Generator().manual_seed(m * 7 + n)
    x = (torch.randn(m, n, generator=g) * 3).to(dtype)
    if zero_row and m:
        x[0] = 0
    r = torch.randn(m, n, generator=g).to(dtype) if residual else None
    if zero_row and residual and m:
        r[0] = 0
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    if residual:
        rows, total = rms_norm_quantized_triton(x, r, w, 1e-6)
        normed, want_total = add_rms_norm(x, r, w, 1e-6)
        return compare(rows, quantize_to_rows(normed), total, want_total)
    return compare(
        rms_norm_quantized_triton(x, None, w, 1e-6), quantize_to_rows(rms_norm(x, w, 1e-6))
    )


def check_silu(m: int, n: int, dtype) -> dict:
    from nanovllm.layers.activation import silu_and_mul
    from nanovllm.quantization.fp8 import quantize_to_rows
    from nanovllm.quantization.fp8_fused import silu_and_mul_quantized_triton

    x = (torch.randn(m, 2 * n, generator=torch.Generator().manual_seed(m + n)) * 4).to(dtype)
    return compare(silu_and_mul_quantized_triton(x), quantize_to_rows(silu_and_mul(x)))


CASES = {
    "norm_f32_one_row": dict(kind="norm", m=1, n=256, dtype=F32, residual=False),
    "norm_bf16_residual": dict(kind="norm", m=20, n=384, dtype=BF16, residual=True),
    "norm_f32_residual_zero_row": dict(
        kind="norm", m=17, n=256, dtype=F32, residual=True, zero_row=True
    ),
    "norm_bf16_narrow_last_group": dict(kind="norm", m=5, n=200, dtype=BF16, residual=False),
    "silu_f32": dict(kind="silu", m=3, n=256, dtype=F32),
    "silu_bf16_past_16_rows": dict(kind="silu", m=33, n=384, dtype=BF16),
    "silu_bf16_narrow_last_group": dict(kind="silu", m=16, n=320, dtype=BF16),
}


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    round_interpreter_casts_to_nearest()

    def call(case):
        case = dict(case)
        return check_norm(**case) if case.pop("kind") == "norm" else check_silu(**case)

    return run_cases(CASES, call)


@pytest.fixture(scope="module")
def results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_quantization_matches_the_torch_composition(results, case):
    r = results[case]
    assert "error" not in r, r["error"]
    assert r["shapes"] == r["want_shapes"] and r["padding_ok"], r
    assert (
        r["q_equal_share"] >= 0.99 and r["beyond_one_step"] == 0 and r["scale_rel_diff"] <= 1e-6
    ), r
    assert r["total_equal"] in (None, True), r


def test_cpu_path_is_the_composition():
    """On the CPU the ops are exactly the unfused op then ``quantize_activation_groups``; and the
    FP8 linear takes the rows as it would take the unquantized activations."""
    from nanovllm.layers.activation import SiluAndMul
    from nanovllm.layers.layernorm import RMSNorm
    from nanovllm.quantization.fp8 import fp8_linear, quantize_weight_blocks
    from nanovllm.quantization.fp8_fused import QuantizedRMSNorm, QuantizedSiluAndMul

    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(6, 256, generator=g).to(BF16), torch.randn(6, 256, generator=g).to(BF16)
    plain, fused = RMSNorm(256).to(BF16), QuantizedRMSNorm(256).to(BF16)
    wq, ws = quantize_weight_blocks(torch.randn(128, 256, generator=g) * 0.05)
    (normed, total), (rows, fused_total) = plain(x, r), fused(x, r)
    assert torch.equal(total, fused_total) and rows.rows == 6 and rows.dtype == BF16
    assert torch.equal(fp8_linear(rows, wq, ws), fp8_linear(normed, wq, ws))
    h = torch.randn(6, 512, generator=g).to(BF16)
    assert torch.equal(
        fp8_linear(QuantizedSiluAndMul()(h), wq, ws), fp8_linear(SiluAndMul()(h), wq, ws)
    )


if __name__ == "__main__":
    import json

    print(json.dumps(run_interpreter_cases()))
