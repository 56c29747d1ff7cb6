"""The FP8 KV cache (``kv_cache_dtype="fp8"``): e4m3 values with one float32 scale per (token, KV
head) row.

- The quantization itself against its definition (scale = max|row| / 448, e4m3 round to nearest
  even) and its error bound.
- The Triton kernels under the Triton interpreter (TRITON_INTERPRET=1 must be set before triton is
  imported, so those cases run together in a subprocess: this file run as a script prints them as
  JSON): the quantizing store against the reference quantization, byte for byte, and decode (with
  and without split-K) and prefill over an FP8 cached prefix against dequantize-then-attend in
  float32 over the same stored values.
- The torch backend's FP8 paths against an independent float64 reference.
- The engine with an FP8 cache, block sizes and refused combinations: test_fp8_kv_engine.py.
"""

import json

import pytest
import torch
from test_attention_backends import (
    CHUNKED_SEQS,
    DECODE_LENS,
    PREFILL_SEQS,
    PREFIX_SEQS,
    paged_layout,
    qkv_views,
    relative_error,
)
from test_kv_store import rope_store_kvcache
from triton_interpreter import (
    results_under_interpreter,
    round_interpreter_casts_to_nearest,
    run_cases,
    squeeze_interpreter_loop_bounds,
)

from nanovllm.layers.attention.fp8_kv import empty_kv_scales, quantize_fp8
from nanovllm.layers.attention.reference import TorchAttentionBackend
from nanovllm.utils.context import Context

E4M3 = torch.float8_e4m3fn
E4M3_NAN = 0x7F  # the byte a cache slot holds until something is stored there
POISON_BYTE = 0x5A  # guards around a cache (e4m3 value 3.25)
POISON_SCALE = -777.0
GUARD = 256
TOL = 1e-5  # float32 on both sides, over the same e4m3 values
# bf16 q and output. The interpreter narrows float32 to bf16 by truncation: that alone gives the
# reference 3.4e-3 on these cases (1.5e-3 rounded to nearest); the float16 dots change it by under
# 1e-5.
BF16_QUERY_TOL = 5e-3


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: per row of the last dimension, s = max(max|row| / 448, 2^-126), the stored
    value e4m3(row / s), rounded to nearest even; computed on the CPU, where both divisions are
    correctly rounded. -> (values, scales), on x's device"""
    device, x = x.device, x.float().cpu()
    scale = torch.clamp(x.abs().amax(dim=-1) / 448.0, min=2.0**-126)
    return (x / scale[..., None]).to(E4M3).to(device), scale.to(device)


def reference_dequantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale[..., None]


def varied_rows(
    *shape: int, decades: float = 6.0, device="cpu", dtype=torch.float32, generator=None
) -> torch.Tensor:
    """Random rows whose magnitudes span ``decades`` powers of ten, centred on 1, from row to row
    (one scale per row must follow)."""
    x = torch.randn(*shape, generator=generator)
    x = x * 10.0 ** ((torch.rand(*shape[:-1], 1, generator=generator) - 0.5) * decades)
    return x.to(device=device, dtype=dtype)


def cache_rows(n: int, num_kv_heads: int, head_dim: int, device) -> torch.Tensor:
    """Rows for attention checks: magnitudes over three decades (wider ones make the softmax so
    peaked that float32 rounding of the scores dominates the comparison)."""
    return varied_rows(n, num_kv_heads, head_dim, decades=3.0, device=device)


def fp8_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device):
    """k_cache, v_cache (NaN bytes) and k_scale, v_scale (NaN) as views of one tensor each, in
    the model runner's layout (the scales head-major)."""
    cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim),
        E4M3_NAN,
        dtype=torch.uint8,
        device=device,
    )
    scales = empty_kv_scales(2, num_blocks, block_size, num_kv_heads, device=device).fill_(
        float("nan")
    )
    cache = cache.view(E4M3)
    return cache[0], cache[1], scales[0], scales[1]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_scales(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0))


def write_rows(
    k_cache, v_cache, k_scale, v_scale, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Put rows into cache slots as an earlier step would have, quantized by the reference."""
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        values, scales = reference_quantize(x)
        cache.view(torch.uint8).flatten(0, 1)[slots] = values.view(torch.uint8)
        set_scales(scale, slots, scales)


def set_scales(scale: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """scale[slot] = values for a [num_blocks, block_size, num_kv_heads] scale tensor of any
    strides."""
    slots = slots.long()
    scale[slots // scale.shape[1], slots % scale.shape[1]] = values


# ---- the checks, run on the CPU under the interpreter and on a GPU -------------------------------


def guarded(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A poisoned, contiguous tensor in the middle of a larger poisoned buffer."""
    n = torch.Size(shape).numel()
    if dtype == E4M3:
        return (
            torch.full((GUARD + n + GUARD,), POISON_BYTE, dtype=torch.uint8)[GUARD : GUARD + n]
            .view(E4M3)
            .view(shape)
        )
    return torch.full((GUARD + n + GUARD,), POISON_SCALE, dtype=dtype)[GUARD : GUARD + n].view(
        shape
    )


def guards_intact(t: torch.Tensor) -> bool:
    raw = t.view(torch.uint8) if t.dtype == E4M3 else t
    buffer = torch.empty(0, dtype=raw.dtype).set_(raw.untyped_storage())
    poison = POISON_BYTE if t.dtype == E4M3 else POISON_SCALE
    return bool(
        (buffer[:GUARD] == poison).all() and (buffer[GUARD + raw.numel() :] == poison).all()
    )


STORE_CASES = {
    "basic": dict(num_tokens=10, num_kv_heads=2, head_dim=16),
    "heads_and_dim_not_power_of_two": dict(num_tokens=9, num_kv_heads=3, head_dim=20),
    "one_kv_head": dict(num_tokens=6, num_kv_heads=1, head_dim=32),
    "qkv_slices_float16": dict(
        num_tokens=12, num_kv_heads=2, head_dim=32, from_qkv=True, dtype=torch.float16
    ),
    "token_major_scales": dict(num_tokens=10, num_kv_heads=3, head_dim=16, head_major=False),
}
# the Triton store (``rope_and_store``) takes a head_dim of a power of two, as every model's is
TRITON_STORE_CASES = [
    name for name, case in STORE_CASES.items() if case["head_dim"] & (case["head_dim"] - 1) == 0
]


def guarded_scales(shape: tuple, head_major: bool) -> torch.Tensor:
    """``guarded`` scales [num_blocks, block_size, num_kv_heads], stored head-major as the model
    runner stores them (``empty_kv_scales``), or contiguous."""
    if not head_major:
        return guarded(shape, torch.float32)
    return guarded((shape[0], shape[2], shape[1]), torch.float32).transpose(1, 2)


def check_store(
    store,
    num_tokens,
    num_kv_heads,
    head_dim,
    from_qkv=False,
    dtype=torch.float32,
    device="cpu",
    head_major=True,
) -> dict:
    """Quantize-and-store into guarded caches: bytes and scales must be the reference's exactly,
    slot -1 skipped, nothing written outside the caches. Row 0 head 0 is all zeros; the other
    rows span six orders of magnitude. ``head_major``: the scales in the model runner's layout."""
    g = torch.Generator().manual_seed(num_tokens * 100 + head_dim)
    num_blocks, block_size = 3, 8
    if from_qkv:
        qkv = varied_rows(num_tokens, 4 * num_kv_heads, head_dim, generator=g).to(dtype)
        k, v = qkv[:, 2 * num_kv_heads : 3 * num_kv_heads], qkv[:, 3 * num_kv_heads :]
        assert not k.is_contiguous()
    else:
        k = varied_rows(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
        v = varied_rows(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    k[0, 0] = 0.0
    slots = torch.randperm(num_blocks * block_size - 1, generator=g)[:num_tokens]  # distinct
    slots[1::3] = -1
    slots[0] = num_blocks * block_size - 1  # the last slot of the cache
    k, v, slots = k.to(device), v.to(device), slots.to(device=device, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads)
    caches = [guarded(shape + (head_dim,), E4M3), guarded(shape + (head_dim,), E4M3)]
    scales = [guarded_scales(shape, head_major), guarded_scales(shape, head_major)]
    if device != "cpu":  # the guards are checked on the CPU copies only
        caches, scales = [c.to(device) for c in caches], [s.to(device) for s in scales]
    expected = [(c.clone(), s.clone()) for c, s in zip(caches, scales)]
    for x, (cache, scale) in zip((k, v), expected):
        valid = slots >= 0
        values, row_scales = reference_quantize(x[valid])
        cache.view(torch.uint8).flatten(0, 1)[slots[valid].long()] = values.view(torch.uint8)
        set_scales(scale, slots[valid], row_scales)
    store(k, v, caches[0], caches[1], slots, scales[0], scales[1])
    problems = []
    for name, got, (ref_cache, ref_scale), got_scale in zip("kv", caches, expected, scales):
        if not same_bytes(got, ref_cache):
            bad = (
                (got.view(torch.uint8) != ref_cache.view(torch.uint8))
                .any(-1)
                .any(-1)
                .nonzero()
                .tolist()
            )
            problems.append(f"{name}_cache differs at (block, offset) {bad[:8]}")
        if not torch.equal(got_scale, ref_scale):
            problems.append(f"{name}_scale differs")
        if device == "cpu" and not (guards_intact(got) and guards_intact(got_scale)):
            problems.append(f"{name}: a write landed outside the cache or its scales")
    zero_row = expected[0][1].flatten(0, 1)[slots[0].long(), 0].item()
    if zero_row != 2.0**-126:
        problems.append(f"the all-zero row has scale {zero_row}")
    return {"problems": "; ".join(problems) or None}


def check_decode(
    backend,
    context_lens,
    *,
    device="cpu",
    dtype=torch.float32,
    head_dim=32,
    block_size=16,
    num_heads=4,
    num_kv_heads=2,
) -> dict:
    """Decode over an FP8 cache against the torch backend's dequantize-then-attend in float32 over
    the same stored values. Slots no sequence owns are NaN; padded rows (context 0) must be
    finite."""
    device = torch.device(device)
    scale = head_dim**-0.5
    blocks, tables, num_blocks = paged_layout([max(n, 1) for n in context_lens], block_size, device)
    k_cache, v_cache, k_scale, v_scale = fp8_cache(
        num_blocks, block_size, num_kv_heads, head_dim, device
    )
    for i, (b, n) in enumerate(zip(blocks, context_lens)):
        if n == 0:
            tables[i] = 0
            continue
        slots = torch.tensor(
            [b[p // block_size] * block_size + p % block_size for p in range(n)], device=device
        )
        write_rows(
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            slots,
            cache_rows(n, num_kv_heads, head_dim, device),
            cache_rows(n, num_kv_heads, head_dim, device),
        )
    q = qkv_views(len(context_lens), num_heads, num_kv_heads, head_dim, dtype, device)[0]
    context = Context(
        is_prefill=False,
        slot_mapping=torch.full((len(context_lens),), -1, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=tables,
    )
    ref = TorchAttentionBackend().decode(
        q.float(), k_cache, v_cache, context, scale, k_scale, v_scale
    )
    out = backend.decode(q, k_cache, v_cache, context, scale, k_scale, v_scale)
    keep = [i for i, n in enumerate(context_lens) if n > 0]
    return {
        "rel_err": relative_error(out[keep], ref[keep]),
        "padded_finite": bool(out.isfinite().all()),
    }


def check_prefill(
    backend,
    seqs,
    *,
    device="cpu",
    dtype=torch.float32,
    head_dim=32,
    block_size=16,
    num_heads=4,
    num_kv_heads=2,
) -> dict:
    """(cached, new) tokens per sequence: the cached prefix is in the FP8 cache already; ``backend``
    stores the new tokens (the kernel backends' store, ``rope_and_store``), then prefills. The
    reference: the torch backend's store and prefill (dequantize-then-attend in float32; over the
    fresh k/v where nothing is cached)."""
    device = torch.device(device)
    scale = head_dim**-0.5
    totals = [c + n for c, n in seqs]
    blocks, tables, num_blocks = paged_layout(totals, block_size, device)
    k_cache, v_cache, k_scale, v_scale = fp8_cache(
        num_blocks, block_size, num_kv_heads, head_dim, device
    )
    slots, cu_q, cu_k = [], [0], [0]
    for b, (c, n) in zip(blocks, seqs):
        seq_slots = [b[p // block_size] * block_size + p % block_size for p in range(c + n)]
        if c:
            write_rows(
                k_cache,
                v_cache,
                k_scale,
                v_scale,
                torch.tensor(seq_slots[:c], device=device),
                cache_rows(c, num_kv_heads, head_dim, device),
                cache_rows(c, num_kv_heads, head_dim, device),
            )
        slots += seq_slots[c:]
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + c + n)
    context = Context(
        is_prefill=True,
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        max_seqlen_q=max(n for _, n in seqs),
        max_seqlen_k=max(totals),
        slot_mapping=torch.tensor(slots, dtype=torch.int32, device=device),
        block_tables=tables if any(c for c, _ in seqs) else None,
    )
    q, k, v = qkv_views(sum(n for _, n in seqs), num_heads, num_kv_heads, head_dim, dtype, device)
    ref_caches = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    reference = TorchAttentionBackend()
    reference.store_kvcache(
        k, v, ref_caches[0], ref_caches[1], context.slot_mapping, ref_caches[2], ref_caches[3]
    )
    ref = reference.prefill(
        q.float(),
        k.float(),
        v.float(),
        ref_caches[0],
        ref_caches[1],
        context,
        scale,
        ref_caches[2],
        ref_caches[3],
    )
    rope_store_kvcache(k, v, k_cache, v_cache, context.slot_mapping, k_scale, v_scale)
    out = backend.prefill(q, k, v, k_cache, v_cache, context, scale, k_scale, v_scale)
    cache_equal = (
        same_bytes(k_cache, ref_caches[0])
        and same_bytes(v_cache, ref_caches[1])
        and same_scales(k_scale, ref_caches[2])
        and same_scales(v_scale, ref_caches[3])
    )
    return {"rel_err": relative_error(out, ref), "cache_equal": cache_equal}


# ---- CPU: the Triton kernels under the interpreter -----------------------------------------------


def small_tiles(num_splits: int):
    """The Triton backend with 16-key decode tiles, one pipeline stage."""
    from nanovllm.layers.attention.triton_backend import TritonAttentionBackend
    from nanovllm.layers.attention.triton_tiles import DecodeTile

    return TritonAttentionBackend(num_splits=num_splits, decode_tile=DecodeTile(16, 1))


INTERPRETER_CASES = {
    **{
        f"store_{name}": (lambda b, name=name: check_store(rope_store_kvcache, **STORE_CASES[name]))
        for name in TRITON_STORE_CASES
    },
    "decode": lambda b: check_decode(b, DECODE_LENS),
    # 16-key tiles: several per sequence (the default tile covers these contexts at once) and per
    # split
    "decode_small_tiles": lambda b: check_decode(small_tiles(1), DECODE_LENS),
    "decode_split4": lambda b: check_decode(small_tiles(4), DECODE_LENS),
    "decode_group8": lambda b: check_decode(b, DECODE_LENS, num_heads=8, num_kv_heads=1),
    "prefill_over_fp8_prefix": lambda b: check_prefill(b, PREFIX_SEQS),
    "chunked_prefill_over_fp8_prefix": lambda b: check_prefill(b, CHUNKED_SEQS),
    "prefill_without_prefix": lambda b: check_prefill(b, PREFILL_SEQS),
    # a bf16 query: the kernels' dots then run in float16 on operands scaled into (-2, 2)
    "decode_bf16_query": lambda b: check_decode(b, DECODE_LENS, dtype=torch.bfloat16),
    "decode_bf16_query_group8": lambda b: check_decode(
        b, DECODE_LENS, dtype=torch.bfloat16, num_heads=8, num_kv_heads=1
    ),
    "prefill_bf16_query": lambda b: check_prefill(b, CHUNKED_SEQS, dtype=torch.bfloat16),
}


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    round_interpreter_casts_to_nearest()
    from nanovllm.layers.attention.triton_backend import TritonAttentionBackend

    torch.manual_seed(0)
    return run_cases(INTERPRETER_CASES, lambda case: case(TritonAttentionBackend(num_splits=1)))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return results_under_interpreter(__file__, timeout=300)


def assert_result(result: dict, tol: float = TOL) -> None:
    assert "error" not in result, result["error"]
    assert result.get("problems") is None, result["problems"]
    if "rel_err" in result:
        assert result["rel_err"] < tol, result
    if "cache_equal" in result:
        assert result["cache_equal"], result
    if "padded_finite" in result:
        assert result["padded_finite"], result


@pytest.mark.parametrize("case", list(INTERPRETER_CASES))
def test_triton_interpreter_fp8(interpreter_results, case):
    assert_result(interpreter_results[case], BF16_QUERY_TOL if "bf16" in case else TOL)


# ---- the quantization and the torch backend, in-process ------------------------------------------


def test_quantization_error_is_bounded():
    """e4m3 keeps 3 mantissa bits: |dequant - x| <= |x| * 2^-4 for normal values, plus half the
    subnormal step (2^-10 of the scale) for the smallest ones of a row. The bound is reached, not
    just met: a coarser format would break it."""
    g = torch.Generator().manual_seed(3)
    x = varied_rows(64, 4, 128, generator=g)
    x[0, 0] = 0.0
    x[1, 1, :64] *= 1e-4  # half a row far below its maximum: e4m3 subnormals
    values, scales = quantize_fp8(x)
    ref_values, ref_scales = reference_quantize(x)
    assert same_bytes(values, ref_values) and torch.equal(scales, ref_scales)
    err = (values.double() * scales.double()[..., None] - x.double()).abs()
    bound = x.double().abs() * (2.0**-4 + 2.0**-20) + scales.double()[..., None] * 2.0**-10
    assert (err <= bound).all(), (err / bound).max()
    assert (err / bound).max() > 0.5
    assert (err.amax(-1) <= x.double().abs().amax(-1) * 2.0**-4 + 1e-30).all()
    assert torch.equal(values[0, 0].float(), torch.zeros(128)) and scales[0, 0] == 2.0**-126


@pytest.mark.parametrize("case", list(STORE_CASES))
def test_torch_backend_store_fp8(case):
    assert (
        check_store(TorchAttentionBackend().store_kvcache, **STORE_CASES[case])["problems"] is None
    )


def float64_attention(q, k, v, scale):
    """One sequence's causal attention in float64, written out: q [nq, H, D], k/v [nk, KVH, D]."""
    num_q, num_heads, _ = q.shape
    num_k, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(num_q, num_heads, q.shape[2], dtype=torch.float64)
    for h in range(num_heads):
        scores = q[:, h].double() @ k[:, h // group].double().T * scale  # [nq, nk]
        visible = torch.arange(num_k)[None, :] <= torch.arange(num_k - num_q, num_k)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[:, h] = probs @ v[:, h // group].double()
    return out


def test_torch_backend_fp8_decode_and_prefill_match_float64_reference():
    """The torch backend over an FP8 cache equals float64 attention over the dequantized rows."""
    torch.manual_seed(5)
    block_size, kv_heads, head_dim = 4, 2, 16
    lens = [7, 1, 12]
    blocks, tables, num_blocks = paged_layout(lens, block_size, "cpu")
    k_cache, v_cache, k_scale, v_scale = fp8_cache(
        num_blocks, block_size, kv_heads, head_dim, "cpu"
    )
    rows = []
    for b, n in zip(blocks, lens):
        slots = torch.tensor([b[p // block_size] * block_size + p % block_size for p in range(n)])
        k, v = cache_rows(n, kv_heads, head_dim, "cpu"), cache_rows(n, kv_heads, head_dim, "cpu")
        write_rows(k_cache, v_cache, k_scale, v_scale, slots, k, v)
        rows.append(tuple(reference_dequantize(*reference_quantize(x)) for x in (k, v)))
    backend, scale = TorchAttentionBackend(), 0.3
    q = torch.randn(len(lens), 4, head_dim)
    context = Context(context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables)
    out = backend.decode(q, k_cache, v_cache, context, scale, k_scale, v_scale)
    for i, (k, v) in enumerate(rows):
        torch.testing.assert_close(
            out[i : i + 1].double(),
            float64_attention(q[i : i + 1], k, v, scale),
            rtol=1e-5,
            atol=1e-5,
        )
    # prefill of each sequence's last 3 tokens (already stored) over its cached prefix
    cu_k = [0, *torch.tensor(lens).cumsum(0).tolist()]
    new = [min(3, n) for n in lens]
    cu_q = [0, *torch.tensor(new).cumsum(0).tolist()]
    q = torch.randn(sum(new), 4, head_dim)
    context = Context(
        is_prefill=True,
        cu_seqlens_q=torch.tensor(cu_q),
        cu_seqlens_k=torch.tensor(cu_k),
        block_tables=tables,
    )
    out = backend.prefill(q, None, None, k_cache, v_cache, context, scale, k_scale, v_scale)
    for i, (k, v) in enumerate(rows):
        expected = float64_attention(q[cu_q[i] : cu_q[i + 1]], k, v, scale)
        torch.testing.assert_close(
            out[cu_q[i] : cu_q[i + 1]].double(), expected, rtol=1e-5, atol=1e-5
        )


if __name__ == "__main__":
    print(json.dumps(run_interpreter_cases()))
