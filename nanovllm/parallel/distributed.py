"""Tensor-parallel rank, size and the layers' all-reduce: the process's default group, or a single
rank without one. Setting the group up and down is ``parallel.group``'s (loaded only with
tensor parallelism), which registers the one-shot all-reduce here."""

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
    """The one-shot all-reduce if it sums ``x`` here: it is enabled, a CUDA graph is being captured
    (eager work always sums through the process group, see docs/parallel.md) and it takes ``x``;
    else None."""
    custom = _custom_all_reduce
    if custom is not None and torch.cuda.is_current_stream_capturing() and custom.fits(x):
        return custom
    return None
