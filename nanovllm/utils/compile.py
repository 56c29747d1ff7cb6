import functools

import torch


def compile_on_gpu(fn):
    """``fn`` compiled for CUDA tensors, eager on the CPU (one graph serves every layer)."""
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
