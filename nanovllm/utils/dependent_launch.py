"""Programmatic dependent launch (docs/quantization.md)."""

import functools

import torch
import triton
import triton.language as tl

ENABLED = True  # False switches it off for every kernel (it changes no result)


@functools.cache
def _supported(device: torch.device) -> bool:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")


def pdl(device: torch.device) -> bool:
    return ENABLED and _supported(device)


def launch_options(device: torch.device) -> dict:
    return {"launch_pdl": True} if pdl(device) else {}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Call before any memory another kernel uses."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    # a hint: the 256 bytes at each 16-byte aligned address into L2; nothing waits for them
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], 256; mov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
