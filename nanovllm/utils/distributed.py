"""Tensor-parallel rank and size: the default process group, or a single rank without one."""
import torch.distributed as dist


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def abort_nccl() -> None:
    """Make NCCL kernels and calls that wait on a dead rank give up. (gloo needs nothing: its
    collectives fail when a peer's connection drops.)"""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
