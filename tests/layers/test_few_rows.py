"""The few-rows RMSNorm and SiLU-and-mul kernels (``layers/few_rows.py``) against
``layernorm.py`` and ``activation.py`` under the Triton interpreter (one subprocess: this file run
as a script): with and without the residual, hidden sizes that are not powers of two, strided rows,
float32 and bf16. The sums of squares are added in another order, so a value may round
differently in its last place (bf16: one step); SiLU-and-mul rounds as torch does, step by step.
The norm of a split GEMM's ranges (``RangeSums``) equals, bit for bit, the norm of their sum
added in order and rounded, as the GEMM would have stored it."""

import pytest
import torch
from triton_interpreter import (
    results_under_interpreter,
    round_interpreter_casts_to_nearest,
    run_cases,
    squeeze_interpreter_loop_bounds,
)

F32, BF16 = torch.float32, torch.bfloat16


def check_norm(rows: int, n: int, dtype=F32, residual=False, strided=False) -> dict:
    from nanovllm.layers import few_rows
    from nanovllm.layers.layernorm import add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(rows * 100 + n)
    x = torch.randn(rows, 2 * n if strided else n, generator=g).to(dtype)[:, :n]
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    if residual:
        r = torch.randn(rows, n, generator=g).to(dtype)
        want, want_sum = add_rms_norm(x, r, w, 1e-6)
        got, got_sum = few_rows.rms_norm(x, w, 1e-6, r)
        sum_equal = bool(torch.equal(got_sum, want_sum))
    else:
        want, got, sum_equal = rms_norm(x, w, 1e-6), few_rows.rms_norm(x, w, 1e-6), True
    diff = (got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-6)
    return {
        "sum_equal": sum_equal,
        "max_rel": diff.max().item(),
        "shape_ok": got.shape == want.shape,
    }


def check_norm_ranges(rows: int, n: int, splits: int, dtype=BF16) -> dict:
    from nanovllm.layers import few_rows
    from nanovllm.layers.layernorm import add_rms_norm
    from nanovllm.layers.rows_gemm import RangeSums

    g = torch.Generator().manual_seed(rows * 100 + n + splits)
    parts = torch.randn(splits, rows, n, generator=g)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    r = torch.randn(rows, n, generator=g).to(dtype)
    x = torch.zeros(rows, n)
    for part in parts:  # in order, as the GEMM's last program adds them
        x += part
    x = x.to(dtype)
    got, got_sum = few_rows.rms_norm(RangeSums(parts, dtype), w, 1e-6, r)
    stored, stored_sum = few_rows.rms_norm(x, w, 1e-6, r)
    want, want_sum = add_rms_norm(x, r, w, 1e-6)
    diff = (got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-6)
    return {
        "sum_equal": bool(torch.equal(got_sum, want_sum) and torch.equal(got_sum, stored_sum)),
        "max_rel": diff.max().item() if torch.equal(got, stored) else float("inf"),
        "shape_ok": got.shape == want.shape and got.dtype == dtype,
    }


def check_silu(rows: int, n: int, dtype=F32) -> dict:
    from nanovllm.layers import few_rows
    from nanovllm.layers.activation import silu_and_mul

    x = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(n)).to(dtype)
    want, got = silu_and_mul(x), few_rows.silu_and_mul(x)
    diff = (got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-6)
    return {"sum_equal": True, "max_rel": diff.max().item(), "shape_ok": got.shape == want.shape}


CASES = {
    "norm": (check_norm, dict(rows=3, n=96)),
    "norm_residual": (check_norm, dict(rows=8, n=320, residual=True)),
    "norm_strided_bf16": (check_norm, dict(rows=2, n=256, dtype=BF16, strided=True, residual=True)),
    "norm_ranges_bf16": (check_norm_ranges, dict(rows=3, n=320, splits=4)),
    "norm_ranges_f32": (check_norm_ranges, dict(rows=1, n=96, splits=2, dtype=F32)),
    "silu": (check_silu, dict(rows=5, n=300)),
    "silu_bf16_wide": (check_silu, dict(rows=1, n=3072, dtype=BF16)),
}


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    round_interpreter_casts_to_nearest()
    return run_cases(CASES, lambda case: case[0](**case[1]))


@pytest.fixture(scope="module")
def results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_torch(results, case):
    r = results[case]
    assert "error" not in r, r["error"]
    assert r["shape_ok"] and r["sum_equal"], r
    step = {F32: 1e-6, BF16: 2**-7}[CASES[case][1].get("dtype", F32)]
    assert r["max_rel"] <= step, r


if __name__ == "__main__":
    import json

    print(json.dumps(run_interpreter_cases()))
