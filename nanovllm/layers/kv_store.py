"""Triton kernel that writes new K/V rows into the paged cache (used on the GPU by every backend)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    k_ptr, k_stride, v_ptr, v_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot == -1:
        return
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    k = tl.load(k_ptr + token * k_stride + cols, mask=mask)
    v = tl.load(v_ptr + token * v_stride + cols, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + cols, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, v, mask=mask)


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k/v: [num_tokens, num_kv_heads, head_dim] (each token's row contiguous);
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous."""
    num_tokens, num_kv_heads, head_dim = k.shape
    row = num_kv_heads * head_dim
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(1) == head_dim and v.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.numel() == num_tokens
    _store_kvcache_kernel[(num_tokens,)](
        k, k.stride(0), v, v.stride(0), k_cache, v_cache, slot_mapping,
        ROW=row, BLOCK=triton.next_power_of_2(row),
    )
