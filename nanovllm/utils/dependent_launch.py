"""Programmatic dependent launch (Hopper and newer): a kernel launched this way may be scheduled
while the kernel before it in the stream is still finishing, so its programs fill the SMs that the
earlier kernel's last programs leave idle, and the gap between two kernels of a CUDA graph closes.

A kernel that takes part gets ``PDL=pdl(device)`` (a constexpr) and ``**launch_options(device)``,
and calls ``wait_for_inputs(PDL)`` before it reads or writes any memory that another kernel of the
step writes or reads: the wait ends when the previous kernel has completed and its writes are
visible. Before the wait a kernel reads nothing; the FP8 GEMM only asks for its first weight tiles
to be brought into L2 (a hint: L2 is where every write lands, so nothing stale can come of it).
Right after the wait it lets the next kernel be scheduled; that kernel waits in turn, so each
kernel still sees all earlier ones complete. A kernel launched without it (torch's, cuBLAS's)
waits for the previous one to complete, as usual.

``ENABLED`` switches it off for every kernel (for measuring; it changes no result)."""

import functools

import torch
import triton
import triton.language as tl

ENABLED = True


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
    """Whether kernels on ``device`` launch as dependents (the ``PDL`` constexpr)."""
    return ENABLED and _supported(device)


def launch_options(device: torch.device) -> dict:
    """The launch keywords that go with ``pdl(device)``."""
    return {"launch_pdl": True} if pdl(device) else {}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the previous kernel has completed, then let the next one be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 256 bytes from each 16-byte aligned address of ``ptrs`` to be brought into L2;
    nothing waits for them."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], 256; mov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
