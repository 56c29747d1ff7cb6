"""One rank's tensor-parallel process group."""

import threading
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from nanovllm.parallel import distributed

_set_up_before = False  # torch sets symmetric memory up once per process


def init_process_group(device: torch.device, rank: int, world_size: int, port: int) -> None:
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        world_size=world_size,
        rank=rank,
        device_id=device if device.type == "cuda" else None,
    )


def enable_custom_all_reduce(device: torch.device, dtype: torch.dtype) -> bool:
    """All ranks call this together; False (rank 0 warns why) unless every rank can."""
    global _set_up_before
    world = dist.get_world_size()
    able = torch.tensor(
        [int(has_symmetric_memory()), int(_reaches_peers(device, world)), int(not _set_up_before)],
        device=device,
    )
    dist.all_reduce(able, op=dist.ReduceOp.MIN)
    symmetric, reaches, fresh = able.tolist()
    if not (symmetric and reaches and fresh):
        if dist.get_rank() == 0:
            why = (
                f"torch {torch.__version__} has no symmetric memory"
                if not symmetric
                else "a GPU of the group does not reach every other directly"
                if not reaches
                else "this process set it up for an earlier engine, and torch sets it up once"
            )
            warnings.warn(
                f"disable_custom_all_reduce=False: the one-shot all-reduce is not used ({why}); "
                "NCCL sums everything",
                stacklevel=2,
            )
        return False
    from nanovllm.parallel.custom_all_reduce import CustomAllReduce

    _set_up_before = True
    try:
        distributed._custom_all_reduce = CustomAllReduce(
            device, dist.get_rank(), world, dist.group.WORLD.group_name, dtype
        )
    except Exception as e:
        raise RuntimeError(
            f"the one-shot all-reduce could not be set up ({type(e).__name__}: {e}); "
            "LLM(..., disable_custom_all_reduce=True) leaves every all-reduce to NCCL"
        ) from e
    return True


def has_symmetric_memory() -> bool:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")


def _reaches_peers(device: torch.device, world: int) -> bool:
    others = [i for i in range(world) if i != device.index]  # rank i runs on cuda:i
    return all(torch.cuda.can_device_access_peer(device.index, other) for other in others)


def abort_custom_all_reduce() -> None:
    """Free every wait of the one-shot all-reduce; safe from any thread (no CUDA call)."""
    custom = distributed._custom_all_reduce
    if custom is not None:
        custom.abort()


def leave_group() -> None:
    # the kernel goes even after an abort: a next engine must not capture it while peers use NCCL
    distributed._custom_all_reduce = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # an aborted group may refuse a clean teardown
            pass


def wait_device(failure: Callable[[], str | None], event: torch.cuda.Event | None = None) -> None:
    """Poll ``event`` (default: the stream's work); raise once ``failure()`` names one."""
    if event is None:
        event = torch.cuda.Event()
        event.record()
    while not event.query():
        if message := failure():
            raise RuntimeError(message)
        time.sleep(0)


def abort_nccl(drop_graphs: Callable[[], None], timeout: float = 30.0) -> bool:
    """Abort NCCL and the one-shot all-reduce, then ``drop_graphs()``; whether the abort ended."""
    abort_custom_all_reduce()
    if not (dist.is_initialized() and dist.get_backend() == "nccl"):
        return True
    # the abort waits until no graph holds NCCL kernels, and destroying a graph waits for its
    # launch: abort in a thread while this one lets the device drain, then drop the graphs
    aborting = threading.Thread(
        target=dist.distributed_c10d._abort_process_group, name="nanovllm-abort", daemon=True
    )
    aborting.start()
    drained = torch.cuda.Event()
    drained.record()
    deadline = time.monotonic() + timeout
    while not drained.query() and time.monotonic() < deadline:
        time.sleep(0.01)
    drop_graphs()
    aborting.join(max(0.0, deadline - time.monotonic()))
    return not aborting.is_alive()
