"""Weights updated in place on every rank and replica, Ctrl-C held until the end."""

from contextlib import suppress

import torch

UPDATE_BATCH = 256  # plan entries per call: a few tens of KB through the control channel
WHERE = " given to update_weights"


def _helpers():
    from nanovllm.utils import weights

    return weights


def plan_rank(runner, tensors: list[tuple[str, tuple, bool]]):
    # the WeightEntry list, or the ValueError (returned: a worker's loop must go on)
    w = _helpers()
    try:
        entries = w.plan_weights(runner.model, [t[:2] for t in tensors], WHERE)
        fp8_names = {e.name for e in entries if tensors[e.index][2]}
        return w.check_fp8_tensors(runner.model, entries, fp8_names, WHERE)
    except ValueError as e:
        return e


def _go_on(runner, error: BaseException | None) -> bool:
    # rank 0 tells every rank whether the load goes on: none is left in a broadcast
    import torch.distributed as dist

    flag = torch.tensor([error is None], dtype=torch.int32, device=runner.device)
    dist.broadcast(flag, 0)
    runner.sync()  # polls on a GPU: a dead rank is an error, not a hang
    return bool(flag.item())


@torch.no_grad()
def load_rank(runner, entries: list, tensors: list[torch.Tensor] | None = None) -> None:
    """Copy planned tensors in place, each rank its shard (rank 0 broadcasts them)."""
    w = _helpers()
    params = dict(runner.model.named_parameters(remove_duplicate=False))
    error = None
    for i, entry in enumerate(entries):
        param = params[entry.target]
        tensor = None if tensors is None else tensors[i]
        if runner.world_size > 1:
            import torch.distributed as dist

            dtype = param.dtype
            if dtype == torch.float8_e4m3fn and not entry.fp8:
                dtype = torch.float32
            if tensor is not None and error is None:
                try:
                    tensor = tensor.to(runner.device, dtype).contiguous()
                except Exception as e:
                    error = e
            if not _go_on(runner, error):
                break
            if tensor is None:
                tensor = torch.empty(entry.shape, dtype=dtype, device=runner.device)
            dist.broadcast(tensor.view(torch.uint8) if entry.fp8 else tensor, 0)  # gloo: no fp8
        try:
            w.copy_weight(param, entry, tensor, WHERE)
        except Exception as e:
            if runner.world_size == 1 or tensors is None:
                raise
            error = e  # the next entry's flag stops the other ranks
    runner.sync()
    if error is not None:
        raise error


def update_weights(engine, weights) -> None:
    """Copy ``(name, tensor)`` pairs into the model, all or none, then drop the prefix cache."""
    from nanovllm.features.idle import check_idle
    from nanovllm.features.sleep import weights_awake
    from nanovllm.parallel.shield import shielded
    from nanovllm.runner.model_runner import RankZeroOnly

    weights_awake(engine)  # asleep too, once wake_up(tags=["weights"]) has run
    named = _helpers().named_tensors(weights)
    check_idle(engine, "update_weights")
    if engine.config.data_parallel_size > 1 or engine.config.data_parallel_backend == "ray":
        named = [(name, tensor.cpu()) for name, tensor in named]  # pickled to each replica
    core = engine.core
    described = [(n, tuple(t.shape), t.dtype == torch.float8_e4m3fn) for n, t in named]
    with shielded():  # every rank and replica ends with all of it or none
        entries = core.collective_rpc(plan_rank, (described,))[0]
        if isinstance(entries, ValueError):
            raise entries
        try:
            for start in range(0, len(entries), UPDATE_BATCH):
                batch = entries[start : start + UPDATE_BATCH]
                tensors = [named[entry.index][1] for entry in batch]
                core.collective_rpc(load_rank, (batch, RankZeroOnly(tensors)))
        except BaseException:
            with suppress(Exception):  # the update's own error matters more
                core.reset_prefix_cache()
            raise
        core.reset_prefix_cache()
