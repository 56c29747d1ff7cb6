"""Tensor-parallel helpers: rank and size (the default process group, or a single rank without
one), the all-reduce of the layers (inside CUDA graphs the one-shot kernel of
``custom_all_reduce`` where it is enabled and takes the tensor, else the process group's), and the
two device waits that must not hang on a dead rank."""

import threading
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist


def init_process_group(device: torch.device, rank: int, world_size: int, port: int) -> None:
    """Join the engine's tensor-parallel group at a local port (NCCL on GPUs, gloo on the CPU)."""
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        world_size=world_size,
        rank=rank,
        device_id=device if device.type == "cuda" else None,
    )


_custom_all_reduce = None  # this process's CustomAllReduce, while enabled
_set_up_before = False  # whether this process has set one up (torch allows it once per process)


def enable_custom_all_reduce(device: torch.device, dtype: torch.dtype) -> bool:
    """Set up the one-shot all-reduce of ``dtype`` tensors for this rank's group on CUDA ``device``
    (every rank calls this together). The ranks first agree that each of them can: its torch has
    symmetric memory, its GPU reaches every other GPU of the group directly, and its process has not
    set the kernel up before (see custom_all_reduce). Returns whether it is enabled; if not, NCCL
    sums everything and rank 0 warns why."""
    global _custom_all_reduce, _set_up_before
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
                else "this process set it up for an earlier engine, and torch sets it up once per process"
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
        _custom_all_reduce = CustomAllReduce(
            device, dist.get_rank(), world, dist.group.WORLD.group_name, dtype
        )
    except Exception as e:
        raise RuntimeError(
            f"the one-shot all-reduce could not be set up ({type(e).__name__}: {e}); "
            "LLM(..., disable_custom_all_reduce=True) leaves every all-reduce to NCCL"
        ) from e
    return True


def has_symmetric_memory() -> bool:
    """Whether this torch has the symmetric memory the one-shot all-reduce maps its buffers with."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")


def _reaches_peers(device: torch.device, world: int) -> bool:
    others = [i for i in range(world) if i != device.index]  # rank i runs on cuda:i
    return all(torch.cuda.can_device_access_peer(device.index, other) for other in others)


def abort_custom_all_reduce() -> None:
    """Free every wait of this process's one-shot all-reduce, running or to come (a peer died); safe
    from any thread, and with no CUDA call, so it also frees a thread blocked in one."""
    custom = _custom_all_reduce
    if custom is not None:
        custom.abort()


def leave_group() -> None:
    """Drop this process's one-shot all-reduce (its buffers go with it) and leave the default group.
    After a rank died, ``abort_nccl`` has already ended the group; the kernel must go all the same,
    or the next engine of this process would capture it in its graphs while its peers sum through
    NCCL, and wait on each other for ever."""
    global _custom_all_reduce
    _custom_all_reduce = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # an aborted group may refuse a clean teardown
            pass


def all_reduce(x: torch.Tensor) -> None:
    """Sum ``x`` over the tensor-parallel ranks, in place: with the one-shot kernel where
    ``custom_all_reduce_for`` gives it, with the process group otherwise."""
    custom = custom_all_reduce_for(x)
    if custom is not None:
        custom(x)
    else:
        dist.all_reduce(x)


def custom_all_reduce_for(x: torch.Tensor):
    """This process's one-shot all-reduce if it sums ``x`` here: it is enabled, the CUDA graph being
    captured holds the call, and the kernel takes ``x``; else None.

    Eager work (prefill steps, the warm-ups) sums through the process group: a kernel that spins
    until its peers arrive, launched eagerly, sits between host work that may wait for the device
    (CUDA documents that loading a kernel can wait for running ones; one stack dump showed a rank
    blocked loading a kernel while its peer waited, BENCHMARKS.md). A graph's replay is one launch
    that holds all of a step's calls, with no host work between them."""
    custom = _custom_all_reduce
    if custom is not None and torch.cuda.is_current_stream_capturing() and custom.fits(x):
        return custom
    return None


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
    """After a rank died: abort NCCL (and the one-shot all-reduce) so that kernels waiting on it
    quit. Returns whether the abort finished (gloo needs none: its collectives fail when a peer's
    connection drops).

    The abort first tells the kernels to quit, then waits until no CUDA graph holds NCCL kernels;
    destroying a graph in turn waits until its launch has ended. So the abort runs in a thread of
    its own while this one lets the device drain, then drops the graphs."""
    abort_custom_all_reduce()  # its kernels wait on the dead rank too
    if not (dist.is_initialized() and dist.get_backend() == "nccl"):
        return True
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
