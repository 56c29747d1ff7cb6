import torch
import torch.distributed as dist

# this process's one-shot all-reduce while enabled (``parallel.group.enable_custom_all_reduce``)
_custom_all_reduce = None


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> None:
    """Sum ``x`` over the tensor-parallel ranks, in place."""
    custom = custom_all_reduce_for(x)
    if custom is not None:
        custom(x)
    else:
        dist.all_reduce(x)


def custom_all_reduce_for(x: torch.Tensor):
    # only inside graph capture: eager work sums through the process group (docs/parallel.md)
    custom = _custom_all_reduce
    if custom is not None and torch.cuda.is_current_stream_capturing() and custom.fits(x):
        return custom
    return None
