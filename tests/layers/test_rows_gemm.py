"""The few-rows linear kernel (``layers/rows_gemm.py``) against torch under the Triton interpreter
(one subprocess: this file run as a script): one row and sixteen, N and K that are not multiples of
the tiles, a bias, K cut into ranges (uneven and empty ones; each case runs twice, so the arrival
counters must have been set back), float32, bf16 and fp16; a split call asked to leave its
ranges to the norm behind (``leave_ranges``) hands parts that add up, in order, to the very output
the kernel stores.

Float32 differs from the float64 product only by the order of the sums (a few ulps of the sums'
magnitude); bf16/fp16 results by one rounding step of the result (the products are exact in
float32, the sums in float32 in another order).
"""

import pytest
import torch
from triton_interpreter import (
    multiply_bf16_as_floats,
    results_under_interpreter,
    round_interpreter_casts_to_nearest,
    run_cases,
    squeeze_interpreter_loop_bounds,
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def check(m: int, n: int, k: int, dtype=F32, bias=False, into=False, ranges=False, **choice):
    from nanovllm.layers.rows_gemm import RangeSums, rows_linear

    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    buffer = torch.full((m, 2 * n), 7.0, dtype=dtype)  # rows of stride 2n: the LM head's out
    out = buffer[:, :n] if into else None
    got = rows_linear(x, w, b, out=out, **choice)
    again = rows_linear(x, w, b, **choice)
    given = torch.empty(m, n, dtype=dtype) if into else None
    left, total = rows_linear(x, w, b, out=given, leave_ranges=ranges, **choice), None
    if isinstance(left, RangeSums):
        total = torch.zeros(m, n)
        for part in left.parts:  # in order, in float32, as the norm adds them
            total += part
    return {
        "ranges_left": list(left.parts.shape) if total is not None else None,
        "ranges_add_up": total is None or bool(torch.equal(total.to(left.dtype), got)),
        "repeatable": bool(torch.equal(got, again)),
        "into_out": bool(
            not into or (got.data_ptr() == buffer.data_ptr() and (buffer[:, n:] == 7).all())
        ),
        "shape": list(got.shape),
        "dtype": str(got.dtype),
        "max_diff": (got.double() - want).abs().max().item(),
        "max_ref": want.abs().max().item(),
        # the sums' magnitude: what float32's order of additions is relative to
        "max_terms": (x.double().abs() @ w.double().abs().T).max().item(),
    }


CASES = {
    "one_row": dict(m=1, n=256, k=256),
    "sixteen_rows_ragged": dict(m=16, n=300, k=200),
    "bias": dict(m=3, n=200, k=384, bias=True),
    "narrow_weight": dict(m=2, n=96, k=256),
    "bf16": dict(m=4, n=256, k=512, dtype=BF16),
    "bf16_bias": dict(m=5, n=130, k=384, dtype=BF16, bias=True),
    "fp16": dict(m=8, n=128, k=256, dtype=F16),
    "split_uneven": dict(m=5, n=300, k=640, splits=3),  # k-blocks 2, 2, 1
    "split_empty_range": dict(m=7, n=256, k=384, splits=4, dtype=BF16, bias=True),  # 1, 1, 1, 0
    "split_narrow_tiles": dict(m=1, n=100, k=1024, splits=8, block_n=32),
    "into_given_rows": dict(m=2, n=200, k=256, dtype=BF16, into=True),
    "into_given_rows_split": dict(m=1, n=130, k=512, into=True, splits=2),
    # leave_ranges: parts [splits, m, n] only where K is split and no bias or out is given
    "ranges_left": dict(m=3, n=200, k=640, splits=4, dtype=BF16, ranges=True),
    "ranges_left_f32": dict(m=1, n=64, k=512, splits=2, ranges=True),
    "ranges_no_split": dict(m=2, n=96, k=256, splits=1, dtype=BF16, ranges=True),
    "ranges_bias": dict(m=2, n=96, k=512, splits=2, dtype=BF16, bias=True, ranges=True),
    "ranges_into_out": dict(m=1, n=130, k=512, into=True, splits=2, ranges=True),
}
LEFT = {"ranges_left": [4, 3, 200], "ranges_left_f32": [2, 1, 64]}


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    round_interpreter_casts_to_nearest()
    multiply_bf16_as_floats()
    return run_cases(CASES, lambda case: check(**case))


@pytest.fixture(scope="module")
def results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_torch(results, case):
    r, c = results[case], CASES[case]
    assert "error" not in r, r["error"]
    dtype = c.get("dtype", F32)
    assert r["shape"] == [c["m"], c["n"]] and r["dtype"] == str(dtype) and r["repeatable"], r
    assert r["into_out"], r
    assert r["ranges_left"] == LEFT.get(case) and r["ranges_add_up"], r
    if dtype == F32:
        assert r["max_diff"] <= 2**-23 * 16 * r["max_terms"], r
    else:  # one rounding step of the result, plus the float32 sums' order
        step = {BF16: 2**-8, F16: 2**-11}[dtype]
        assert r["max_diff"] <= step * r["max_ref"] + 2**-20 * r["max_terms"], r


def test_choice_follows_the_sweep():
    """(BLOCK_N, SPLIT_K, stages) at Qwen3's decode shapes: the rule drawn from the sweep of
    benchmarks/bench_rows_gemm.py (its figures in BENCHMARKS.md, "Decode at batch 1")."""
    from nanovllm.layers.rows_gemm import choose

    assert choose(4096, 1024) == (32, 1, 4)  # Qwen3-0.6B qkv: 128 tiles already
    assert choose(1024, 2048) == (32, 4, 4)  # its o_proj: 32 tiles x 4 ranges of 4 blocks
    assert choose(1024, 3072) == (32, 4, 4)  # its down_proj: ranges of 6 blocks
    assert choose(4096, 4096) == (32, 1, 6)  # Qwen3-8B o_proj: 128 tiles of 32 blocks
    assert choose(24576, 4096) == (64, 1, 4)  # its gate_up_proj: 384 wide tiles
    assert choose(151936, 1024) == (64, 1, 4)  # the LM head
    assert choose(100, 128) == (32, 1, 4)  # one block of K: nothing to split


def test_bad_shapes_are_refused():
    from nanovllm.layers.rows_gemm import rows_linear

    with pytest.raises(ValueError, match=r"M <= 16, K.*\(17, 64\)"):
        rows_linear(torch.zeros(17, 64), torch.zeros(8, 64))
    with pytest.raises(ValueError, match=r"\(8, 32\)"):
        rows_linear(torch.zeros(2, 64), torch.zeros(8, 32))


if __name__ == "__main__":
    import json

    print(json.dumps(run_interpreter_cases()))
