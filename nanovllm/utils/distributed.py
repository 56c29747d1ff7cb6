"""Tensor-parallel helpers: rank and size (the default process group, or a single rank without
one), and the two device waits that must not hang on a dead rank."""
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def init_process_group(device: torch.device, rank: int, world_size: int, port: int) -> None:
    """Join the engine's tensor-parallel group at a local port (NCCL on GPUs, gloo on the CPU)."""
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
        world_size=world_size, rank=rank, device_id=device if device.type == "cuda" else None,
    )


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def wait_device(failure: Callable[[], str | None], event: torch.cuda.Event | None = None) -> None:
    """Wait for ``event`` (default: the work queued on the current CUDA stream so far) by polling,
    raising ``RuntimeError`` as soon as ``failure()`` names a dead rank: a collective that waits on
    it would never end."""
    if event is None:
        event = torch.cuda.Event()
        event.record()
    while not event.query():
        if message := failure():
            raise RuntimeError(message)
        time.sleep(0)


def abort_nccl(drop_graphs: Callable[[], None], timeout: float = 30.0) -> bool:
    """After a rank died: abort NCCL so that kernels waiting on it quit. Returns whether the abort
    finished (gloo needs none: its collectives fail when a peer's connection drops).

    The abort first tells the kernels to quit, then waits until no CUDA graph holds NCCL kernels;
    destroying a graph in turn waits until its launch has ended. So the abort runs in a thread of
    its own while this one lets the device drain, then drops the graphs."""
    if not (dist.is_initialized() and dist.get_backend() == "nccl"):
        return True
    aborting = threading.Thread(target=dist.distributed_c10d._abort_process_group, name="nanovllm-abort", daemon=True)
    aborting.start()
    drained = torch.cuda.Event()
    drained.record()
    deadline = time.monotonic() + timeout
    while not drained.query() and time.monotonic() < deadline:
        time.sleep(0.01)
    drop_graphs()
    aborting.join(max(0.0, deadline - time.monotonic()))
    return not aborting.is_alive()
