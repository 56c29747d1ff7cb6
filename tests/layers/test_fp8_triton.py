"""The block-FP8 linear kernel (``fp8_triton.py``) against the torch path of ``fp8.py`` under the
Triton interpreter (one subprocess: this file run as a script): token counts on each tile size and
past it, K and N that are not multiples of 128 or of the tiles (plain loads; multiples of 16 take
the TMA descriptors), an all-zero activation group (scale 1), float32, bf16 and fp16 activations, a
bias, a float32 result, strided rows, no rows, K cut into ranges (split-K: uneven and empty ranges;
each case runs twice, so the arrival counters must have been set back). Then the FP8
Mixture-of-Experts kernels (``fused_moe_fp8``) against ``fused_moe_torch_fp8``: decode-sized and
uneven routings, a hidden size that is not a multiple of 128, bf16.

The products of e4m3 values are exact in float32 and the k-blocks are summed in the same order, so
the two differ only by the order of the sums inside a k-block (and, split, of the ranges' sums):
within a few float32 ulps of the result's magnitude, and in bf16/fp16 by at most one rounding step
of the result.
"""

import pytest
import torch
from triton_interpreter import (
    results_under_interpreter,
    round_interpreter_casts_to_nearest,
    run_cases,
    squeeze_interpreter_loop_bounds,
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def check(
    m: int,
    n: int,
    k: int,
    dtype=F32,
    bias: bool = False,
    out_dtype=None,
    strided: bool = False,
    zero_group: bool = False,
    splits: int | None = None,
) -> dict:
    from nanovllm.quantization.fp8 import fp8_linear, quantize_weight_blocks
    from nanovllm.quantization.fp8_triton import fp8_linear_triton

    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, 2 * k if strided else k, generator=g).to(dtype)
    x = x[:, ::2] if strided else x
    if zero_group and m:
        x[0, :128] = 0
    wq, ws = quantize_weight_blocks(torch.randn(n, k, generator=g) * 0.05)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = fp8_linear(x, wq, ws, b, out_dtype)
    got = fp8_linear_triton(x, wq, ws, b, out_dtype, splits=splits)
    again = fp8_linear_triton(x, wq, ws, b, out_dtype, splits=splits)  # the counters were set back
    diff = (got.double() - ref.double()).abs()
    return {
        "repeatable": bool(torch.equal(got, again)),
        "shape": list(got.shape),
        "want_shape": list(ref.shape),
        "dtype": str(got.dtype),
        "want_dtype": str(ref.dtype),
        "max_diff": diff.max().item() if diff.numel() else 0.0,
        "max_ref": ref.abs().max().item() if ref.numel() else 0.0,
        "finite": bool(got.isfinite().all()),
    }


def check_moe(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype=F32
) -> dict:
    from nanovllm.layers.moe.fused_fp8 import fused_moe_fp8, fused_moe_torch_fp8
    from nanovllm.layers.moe.layer import select_experts
    from nanovllm.quantization.fp8 import quantize_weight_blocks

    g = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13, w13_scale = map(
        torch.stack,
        zip(
            *(
                quantize_weight_blocks(torch.randn(2 * inter, hidden, generator=g) * 0.05)
                for _ in range(num_experts)
            )
        ),
    )
    w2, w2_scale = map(
        torch.stack,
        zip(
            *(
                quantize_weight_blocks(torch.randn(hidden, inter, generator=g) * 0.05)
                for _ in range(num_experts)
            )
        ),
    )
    weights, ids = select_experts(
        torch.randn(num_tokens, num_experts, generator=g) * 3, top_k, True
    )
    ref = fused_moe_torch_fp8(x, w13, w13_scale, w2, w2_scale, weights, ids)
    got = fused_moe_fp8(x, w13, w13_scale, w2, w2_scale, weights, ids)
    diff = (got.double() - ref.double()).abs()
    return {
        "shape": list(got.shape),
        "want_shape": list(ref.shape),
        "dtype": str(got.dtype),
        "want_dtype": str(ref.dtype),
        "max_diff": diff.max().item() if diff.numel() else 0.0,
        "max_ref": ref.abs().max().item() if ref.numel() else 0.0,
        "finite": bool(got.isfinite().all()),
    }


def check_padded_quantization(m: int, k: int, row_multiple: int) -> dict:
    """``quantize_rows`` with rows padded (cuBLAS's GEMM wants multiples of 16): the first m rows as
    ``quantize_activation_groups``, the padding zeros with scale 1."""
    from nanovllm.quantization.fp8 import quantize_activation_groups
    from nanovllm.quantization.fp8_triton import quantize_rows

    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(BF16)
    q, scales = quantize_rows(x, row_multiple)
    want_q, want_scales = quantize_activation_groups(x)
    return {
        "shape": [list(q.shape), list(scales.shape)],
        "rows_equal": bool(torch.equal(q[:m].view(torch.uint8), want_q.view(torch.uint8))),
        "scales_equal": bool(torch.equal(scales[:, :m], want_scales.T)),
        "padding_zero": bool((q[m:].float() == 0).all()),
        "padding_scale_one": bool((scales[:, m:] == 1).all()),
    }


PADDED_CASES = {
    "pad_5_to_16": dict(m=5, k=256, row_multiple=16),
    "pad_33_to_48": dict(m=33, k=200, row_multiple=16),
}

MOE_CASES = {
    "moe_decode": dict(num_tokens=3, num_experts=8, top_k=2, hidden=256, inter=128),
    "moe_uneven": dict(num_tokens=40, num_experts=4, top_k=3, hidden=320, inter=256),
    "moe_bf16": dict(num_tokens=20, num_experts=6, top_k=2, hidden=256, inter=128, dtype=BF16),
}

CASES = {
    "decode_m1": dict(m=1, n=256, k=256),
    "decode_m16": dict(m=16, n=300, k=200),
    "m17_to_64_tile": dict(m=17, n=130, k=384),
    "m130_large_tile": dict(m=130, n=260, k=300),
    "no_rows": dict(m=0, n=128, k=128),
    "zero_group": dict(m=5, n=128, k=256, zero_group=True),
    "bf16_bias": dict(m=9, n=200, k=256, dtype=BF16, bias=True),
    "fp16": dict(m=20, n=128, k=384, dtype=F16),
    "bf16_to_float32": dict(m=7, n=256, k=256, dtype=BF16, out_dtype=F32),
    "strided_rows": dict(m=6, n=128, k=256, strided=True),
    "split_k_uneven_ranges": dict(m=5, n=300, k=640, splits=3),  # k-blocks 2, 2, 1
    "split_k_empty_range": dict(m=20, n=256, k=384, splits=4, dtype=BF16, bias=True),  # 1, 1, 1, 0
    "split_k_tma": dict(m=70, n=256, k=1024, splits=2),
}


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    round_interpreter_casts_to_nearest()
    results = run_cases(CASES, lambda case: check(**case))
    results |= run_cases(PADDED_CASES, lambda case: check_padded_quantization(**case))
    return results | run_cases(MOE_CASES, lambda case: check_moe(**case))


@pytest.fixture(scope="module")
def results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_torch_path(results, case):
    r = results[case]
    assert "error" not in r, r["error"]
    assert r["shape"] == r["want_shape"] and r["dtype"] == r["want_dtype"] and r["finite"], r
    assert r["repeatable"], r
    out_dtype = CASES[case].get("out_dtype") or CASES[case].get("dtype", F32)
    step = {F32: 2**-23 * 8, BF16: 2**-7, F16: 2**-10}[
        out_dtype
    ]  # a few ulps, or one rounding step
    assert r["max_diff"] <= step * max(r["max_ref"], 1e-30), r


@pytest.mark.parametrize("case", list(PADDED_CASES))
def test_padded_quantization(results, case):
    r, c = results[case], PADDED_CASES[case]
    assert "error" not in r, r["error"]
    padded = -(-c["m"] // c["row_multiple"]) * c["row_multiple"]
    assert r["shape"] == [[padded, c["k"]], [-(-c["k"] // 128), padded]], r
    assert r["rows_equal"] and r["scales_equal"] and r["padding_zero"] and r["padding_scale_one"], r


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_kernels_match_the_torch_path(results, case):
    """Float32 up to the order of the sums; in bf16 h is rounded before its quantization, where a
    one-step difference can move an e4m3 value, so there the bound is a few bf16 steps."""
    r = results[case]
    assert "error" not in r, r["error"]
    assert r["shape"] == r["want_shape"] and r["dtype"] == r["want_dtype"] and r["finite"], r
    step = {F32: 1e-5, BF16: 2**-5}[MOE_CASES[case].get("dtype", F32)]
    assert r["max_diff"] <= step * r["max_ref"], r


def test_tiles_cover_decode_and_prefill():
    from nanovllm.quantization.fp8_triton import tile

    tiles = {m: tile(m) for m in (1, 16, 17, 32, 33, 64, 65, 256, 257, 512, 513, 8192)}
    assert {m: t[:2] for m, t in tiles.items()} == {
        1: (16, 64),
        16: (16, 64),
        17: (32, 64),
        32: (32, 64),
        33: (64, 64),
        64: (64, 64),
        65: (64, 128),
        256: (64, 128),
        257: (64, 128),
        512: (64, 128),
        513: (128, 128),
        8192: (128, 128),
    }
    assert all(
        128 % t.block_n == 0 for t in tiles.values()
    )  # one weight scale per tile and k-block
    assert tiles[1].num_stages == 4  # the sweep at one row: 6 stages were up to 1.4 us slower


def test_split_k_at_the_qwen3_8b_shapes_on_132_sms():
    """The rule's splits at the shapes of the H100 sweep (BENCHMARKS.md: the best measured or within
    1 µs of it but at two points): qkv, o and down cut into ranges at decode sizes, gate_up (many
    tiles) never, fewer ranges as the rows grow."""
    import triton

    from nanovllm.quantization.fp8_triton import split_k, tile

    layers = {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (24576, 4096),
        "down": (4096, 12288),
    }

    def splits(m, n, k):
        t = tile(m)
        return split_k(m, k, triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), 132)

    got = {
        name: [splits(m, n, k) for m in (1, 16, 32, 64, 128, 256, 2048)]
        for name, (n, k) in layers.items()
    }
    assert got == {
        "qkv": [4, 4, 4, 2, 1, 1, 1],
        "o": [4, 4, 4, 2, 1, 1, 1],
        "gate_up": [1] * 7,
        "down": [4, 4, 4, 4, 4, 2, 1],
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run_interpreter_cases()))
