"""A copy by a kernel, so that a CUDA graph can read or write pinned host memory itself (mapped
into the device's address space) where a copy engine would start and end outside it."""

import torch
import triton
import triton.language as tl

BLOCK = 1024  # 4-byte words a program


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_words(src: torch.Tensor, dst: torch.Tensor, nbytes: int) -> None:
    """``dst``'s first ``nbytes`` bytes (a multiple of 4) from ``src``'s; either may be pinned."""
    if nbytes % 4 or nbytes > min(src.nbytes, dst.nbytes):
        raise ValueError(f"copy_words copies whole 4-byte words within both; got {nbytes} bytes")
    words = nbytes // 4
    if words == 0:
        return
    src, dst = src.view(torch.uint8)[:nbytes], dst.view(torch.uint8)[:nbytes]
    _copy_kernel[(triton.cdiv(words, BLOCK),)](
        src.view(torch.int32), dst.view(torch.int32), words, BLOCK=BLOCK
    )
