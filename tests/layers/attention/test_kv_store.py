"""The KV stores against a plain indexing reference.

The Triton store is ``nanovllm.layers.attention.kv_store.rope_and_store`` (QK-norm, RoPE and the
store in one kernel); ``rope_store_kvcache`` reaches its store with the rotation by angle 0 and no
norm, so the rows stored are k's and v's. It runs on the CPU under the Triton interpreter.
TRITON_INTERPRET=1 is only honoured if it is set before triton is first imported, and other test
modules may import triton earlier in the same pytest process, so the Triton cases run together in
one subprocess: this file run as a script prints one verdict per case as JSON. The torch backend's
``store_kvcache`` runs the same cases in-process. Every cache is poisoned first, so a write to a
wrong slot, a skipped slot (-1) or past the row shows up.
"""

import json
import os
import sys

import pytest
import torch
from triton_interpreter import results_under_interpreter

POISON = -777.0
GUARD = 1024  # poisoned elements on each side of a cache


def make_case(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    num_blocks: int,
    block_size: int,
    slots: list[int] | None = None,
    from_qkv: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """Inputs for one store: k/v ``[num_tokens, num_kv_heads, head_dim]`` (optionally strided views
    into a fused qkv tensor), poisoned caches and a slot mapping (distinct slots, some -1)."""
    g = torch.Generator().manual_seed(seed)
    kv_size = num_kv_heads * head_dim
    if from_qkv:
        q_size = 2 * kv_size
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g).to(dtype)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
        assert not k.is_contiguous() and not v.is_contiguous()
    else:
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    if slots is None:
        slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].tolist()
        for i in range(0, num_tokens, 3):
            slots[i] = -1
    k_cache = guarded_cache((num_blocks, block_size, num_kv_heads, head_dim), dtype)
    v_cache = guarded_cache((num_blocks, block_size, num_kv_heads, head_dim), dtype)
    return k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32)


def guarded_cache(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A poisoned, contiguous cache that is a view into the middle of a larger poisoned buffer,
    so a write before or after the cache (a bad slot, an unmasked lane) is caught, not a crash."""
    n = torch.Size(shape).numel()
    buffer = torch.full((GUARD + n + GUARD,), POISON, dtype=dtype)
    return buffer[GUARD : GUARD + n].view(shape)


def guards_intact(cache: torch.Tensor) -> bool:
    buffer = torch.empty(0, dtype=cache.dtype).set_(cache.untyped_storage())
    n = cache.numel()
    return bool((buffer[:GUARD] == POISON).all() and (buffer[GUARD + n :] == POISON).all())


CASES = {
    # row of 2 * 16 = 32 values (a power of two), a third of the slots -1
    "basic": dict(num_tokens=10, num_kv_heads=2, head_dim=16, num_blocks=4, block_size=8),
    # row of 3 * 20 = 60 values: the kernel's power-of-two block must be masked
    "row_not_power_of_two": dict(
        num_tokens=9, num_kv_heads=3, head_dim=20, num_blocks=3, block_size=16
    ),
    "row_not_power_of_two_odd": dict(
        num_tokens=5, num_kv_heads=1, head_dim=7, num_blocks=2, block_size=4
    ),
    # k and v are strided views into one qkv projection output
    "qkv_slices": dict(
        num_tokens=12, num_kv_heads=2, head_dim=32, num_blocks=4, block_size=16, from_qkv=True
    ),
    "qkv_slices_not_power_of_two": dict(
        num_tokens=6, num_kv_heads=3, head_dim=12, num_blocks=2, block_size=8, from_qkv=True
    ),
    "all_slots_skipped": dict(
        num_tokens=4, num_kv_heads=2, head_dim=16, num_blocks=2, block_size=4, slots=[-1] * 4
    ),
    # first and last slot of the cache, and a padded decode row at the end
    "cache_edges": dict(
        num_tokens=3, num_kv_heads=2, head_dim=8, num_blocks=3, block_size=4, slots=[11, 0, -1]
    ),
    "single_token": dict(
        num_tokens=1, num_kv_heads=4, head_dim=64, num_blocks=2, block_size=16, slots=[17]
    ),
    "float16": dict(
        num_tokens=8, num_kv_heads=2, head_dim=24, num_blocks=2, block_size=8, dtype=torch.float16
    ),
    # the Triton store pads the heads to a power of two: those lanes must be masked
    "heads_not_power_of_two": dict(
        num_tokens=9, num_kv_heads=3, head_dim=16, num_blocks=3, block_size=16
    ),
    "five_heads": dict(num_tokens=5, num_kv_heads=5, head_dim=8, num_blocks=2, block_size=4),
    "qkv_slices_heads_not_power_of_two": dict(
        num_tokens=6, num_kv_heads=3, head_dim=8, num_blocks=2, block_size=8, from_qkv=True
    ),
    "float16_heads_not_power_of_two": dict(
        num_tokens=8, num_kv_heads=3, head_dim=16, num_blocks=2, block_size=8, dtype=torch.float16
    ),
}
# rope_and_store rotates halves of head_dim that must be a power of two, as every model's is: the
# Triton store takes the cases of such a head_dim (the torch store takes them all)
TRITON_CASES = [
    name for name, case in CASES.items() if case["head_dim"] & (case["head_dim"] - 1) == 0
]


def rope_store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store k/v ``[num_tokens, num_kv_heads, head_dim]`` through ``kv_store.rope_and_store``, the
    one Triton store: k and v packed as a fused projection (k's rows standing in for q), no QK-norm,
    and RoPE by the angle 0 (cos 1, sin 0: ``x * 1 - y * 0`` is x exactly), so the rows stored are
    k's and v's, as the model's store writes its already rotated rows."""
    from nanovllm.layers.attention.kv_store import rope_and_store

    num_tokens, num_kv_heads, head_dim = k.shape
    qkv = torch.cat([k, k, v], dim=1).flatten(1)  # [num_tokens, 3 * num_kv_heads * head_dim]
    positions = torch.zeros(num_tokens, dtype=torch.int64, device=k.device)
    half = head_dim // 2
    cos_sin = torch.cat([torch.ones(half), torch.zeros(half)]).view(1, 1, head_dim).to(k.device)
    rope_and_store(
        qkv,
        positions,
        num_kv_heads,
        num_kv_heads,
        cos_sin,
        None,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        write_k=False,
    )


def reference_store(k, v, k_cache, v_cache, slot_mapping):
    """Row by row: slot s is block s // block_size, offset s % block_size; -1 is skipped."""
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    block_size = k_cache.size(1)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot != -1:
            k_ref[slot // block_size, slot % block_size] = k[token]
            v_ref[slot // block_size, slot % block_size] = v[token]
    return k_ref, v_ref


def check_case(name: str, store) -> str | None:
    """None if ``store`` writes exactly what the reference writes, else a description."""
    k, v, k_cache, v_cache, slots = make_case(**CASES[name])
    k_before, v_before = k.clone(), v.clone()
    k_ref, v_ref = reference_store(k, v, k_cache, v_cache, slots)
    store(k, v, k_cache, v_cache, slots)
    problems = []
    for what, got, ref in (("k_cache", k_cache, k_ref), ("v_cache", v_cache, v_ref)):
        if not torch.equal(got, ref):
            bad = (got != ref).any(dim=-1).any(dim=-1).nonzero().tolist()  # [block, offset] pairs
            problems.append(f"{what} differs at (block, offset) {bad[:8]}")
        if not guards_intact(got):
            problems.append(f"{what}: a write landed outside the cache")
    if not (torch.equal(k, k_before) and torch.equal(v, v_before)):
        problems.append("the inputs k/v were modified")
    return "; ".join(problems) or None


def run_triton_cases() -> dict[str, str | None]:
    results = {}
    for name in TRITON_CASES:
        try:
            results[name] = check_case(name, rope_store_kvcache)
        except Exception as e:  # report, so one broken case does not hide the others
            results[name] = f"raised {type(e).__name__}: {e}"
    return results


@pytest.fixture(scope="module")
def triton_results() -> dict[str, str | None]:
    return results_under_interpreter(__file__, timeout=300)


@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_store_kvcache(name, triton_results):
    assert triton_results[name] is None, triton_results[name]


@pytest.mark.parametrize("name", CASES)
def test_torch_backend_store_kvcache(name):
    from nanovllm.layers.attention.reference import TorchAttentionBackend

    assert check_case(name, TorchAttentionBackend().store_kvcache) is None


def test_reference_store_is_not_a_no_op():
    """The poisoning makes a store that writes nothing (or everything) fail."""
    k, v, k_cache, v_cache, slots = make_case(**CASES["basic"])
    k_ref, _ = reference_store(k, v, k_cache, v_cache, slots)
    written = (k_ref != POISON).all(dim=-1).all(dim=-1).sum().item()
    assert written == (slots != -1).sum().item() > 0
    assert check_case("basic", lambda *args: None) is not None


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(
            "run with TRITON_INTERPRET=1 (the Triton interpreter) set before triton is imported"
        )
    print(json.dumps(run_triton_cases()))
