"""``kv_store.rope_and_store`` (QK-norm, RoPE and the KV-cache store in one Triton kernel) against
the plain path it replaces on the GPU: ``rms_norm`` and ``apply_rotary_emb`` run eagerly, then a
row-by-row store (and ``quantize_fp8`` for an FP8 cache).

The kernel runs under the Triton interpreter in a subprocess (this file run as a script, see
``triton_interpreter.py``). Caches and scales are poisoned, inside larger poisoned buffers, so a
write to a wrong slot, a skipped slot (-1) or outside the cache shows up.
"""

import json
import os
import sys

import pytest
import torch
from test_kv_store import POISON, guarded_cache, guards_intact, reference_store
from triton_interpreter import results_under_interpreter

from nanovllm.layers.attention.fp8_kv import quantize_fp8
from nanovllm.layers.layernorm import rms_norm
from nanovllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb

CASES = {
    "float32_qk_norm": dict(num_heads=4, num_kv_heads=2, head_dim=16),
    "bfloat16_qk_norm": dict(num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16),
    "float32_no_norm": dict(num_heads=4, num_kv_heads=2, head_dim=16, norm=False),
    "bfloat16_heads_not_power_of_two": dict(
        num_heads=6, num_kv_heads=3, head_dim=16, dtype=torch.bfloat16
    ),
    "fp8_cache": dict(num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16, fp8=True),
    "fp8_cache_float32": dict(num_heads=2, num_kv_heads=1, head_dim=16, fp8=True),
    "no_cache_decode": dict(num_heads=4, num_kv_heads=2, head_dim=16, store=False, write_k=False),
}
# the kernel sums the squares in another order than torch's mean: a float32 result may differ in
# its last bits, and a bf16 one by one rounding step where that moves a value across a boundary
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def run_case(
    num_heads,
    num_kv_heads,
    head_dim,
    dtype=torch.float32,
    norm=True,
    fp8=False,
    store=True,
    write_k=True,
    num_tokens=11,
    num_blocks=3,
    block_size=8,
    seed=0,
) -> dict:
    from nanovllm.layers.attention.kv_store import rope_and_store

    g = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = (torch.randn(num_tokens, q_size + 2 * kv_size, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 500, (num_tokens,), generator=g)
    rope = RotaryEmbedding(head_dim, 512, 1e6)
    weights = [(torch.rand(head_dim, generator=g) + 0.5).to(dtype) for _ in range(2)]
    eps = 1e-6
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::4] = -1
    slots = slots.to(torch.int32)
    cache_dtype = torch.float8_e4m3fn
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if fp8:  # e4m3 has no -777: NaN marks the slots nothing may write
        k_cache, v_cache = (torch.full(shape, float("nan")).to(cache_dtype) for _ in range(2))
    else:
        k_cache, v_cache = (guarded_cache(shape, dtype) for _ in range(2))
    # scales head-major, as the model runner stores them (``empty_kv_scales``)
    k_scale, v_scale = (
        (
            guarded_cache((num_blocks, num_kv_heads, block_size), torch.float32).transpose(1, 2)
            for _ in range(2)
        )
        if fp8
        else (None, None)
    )
    if not store:
        k_cache = v_cache = torch.tensor([], dtype=dtype)

    q_ref, k_ref, v_ref = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q_ref = q_ref.reshape(num_tokens, num_heads, head_dim)
    k_ref = k_ref.reshape(num_tokens, num_kv_heads, head_dim)
    v_ref = v_ref.reshape(num_tokens, num_kv_heads, head_dim)
    if norm:
        q_ref, k_ref = rms_norm(q_ref, weights[0], eps), rms_norm(k_ref, weights[1], eps)
    q_ref, k_ref = apply_rotary_emb(positions, q_ref, k_ref, rope.cos_sin_cache)

    q, k, v = rope_and_store(
        qkv,
        positions,
        num_heads,
        num_kv_heads,
        rope.cos_sin_cache,
        (weights[0], weights[1], eps) if norm else None,
        k_cache,
        v_cache,
        slots,
        k_scale,
        v_scale,
        write_k=write_k,
    )
    tol = TOLERANCE[dtype]
    out = dict(
        q_err=rel_err(q, q_ref, tol),
        k_none=k is None,
        v_is_view=v.data_ptr() == qkv[:, q_size + kv_size :].data_ptr(),
        v_equal=torch.equal(v, v_ref),
    )
    if write_k:
        out["k_err"] = rel_err(k, k_ref, tol)
    if store:
        k_src = k if write_k else k_ref
        if fp8:  # the stored rows are exactly quantize_fp8 of the kernel's own rotated k (and of v)
            ok = True
            for token, slot in enumerate(slots.tolist()):
                b, o = divmod(slot, block_size)
                if slot == -1:
                    continue
                for src, cache, scale in ((k_src, k_cache, k_scale), (v_ref, v_cache, v_scale)):
                    values, s = quantize_fp8(src[token])
                    ok &= torch.equal(
                        cache[b, o].view(torch.uint8), values.view(torch.uint8)
                    ) and torch.equal(scale[b, o], s)
            written = sum(s != -1 for s in slots.tolist())
            untouched = (
                int(torch.isnan(k_cache.float()).all(-1).all(-1).sum())
                == num_blocks * block_size - written
            )
            out.update(
                stored_exact=ok,
                untouched_slots=untouched,
                guards=guards_intact(k_scale) and guards_intact(v_scale),
                scale_poison_left=int((k_scale == POISON).sum())
                == (num_blocks * block_size - written) * num_kv_heads,
            )
        else:
            poisoned = torch.full(shape, POISON, dtype=dtype)
            k_expect, v_expect = reference_store(k_src, v_ref, poisoned, poisoned, slots)
            out.update(
                stored_exact=torch.equal(k_cache, k_expect) and torch.equal(v_cache, v_expect),
                guards=guards_intact(k_cache) and guards_intact(v_cache),
            )
    return out


def rel_err(got: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    """Every element within ``tol`` of the reference, relative to the tensor's largest magnitude."""
    return bool(((got.float() - ref.float()).abs() <= tol * ref.float().abs().amax()).all())


@pytest.fixture(scope="module")
def results() -> dict:
    return results_under_interpreter(__file__, timeout=300)


@pytest.mark.parametrize("name", CASES)
def test_rope_and_store_matches_plain_path(name, results):
    r = results[name]
    assert "error" not in r, r
    assert r["q_err"] and r["v_equal"] and r["v_is_view"], r
    case = CASES[name]
    assert r["k_none"] == (not case.get("write_k", True))
    if case.get("write_k", True):
        assert r["k_err"], r
    if case.get("store", True):
        assert r["stored_exact"] and r["guards"], r
        if case.get("fp8"):
            assert r["untouched_slots"] and r["scale_poison_left"], r


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(
            "run with TRITON_INTERPRET=1 (the Triton interpreter) set before triton is imported"
        )
    from triton_interpreter import (
        round_interpreter_casts_to_nearest,
        run_cases,
        squeeze_interpreter_loop_bounds,
    )

    squeeze_interpreter_loop_bounds()
    round_interpreter_casts_to_nearest()
    print(json.dumps(run_cases({name: (lambda c=c: run_case(**c)) for name, c in CASES.items()})))
