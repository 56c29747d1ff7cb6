import functools

import torch


def compile_on_gpu(fn):
    """``fn`` through ``torch.compile`` when its first argument is a CUDA tensor, else eager. ``fn``
    must be a plain function of tensors, so one compiled graph serves every layer."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return wrapper
