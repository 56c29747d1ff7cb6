"""Weight updates in place (RL rollouts between training steps): ``update_weights(engine,
weights)``. Rank 0 plans every tensor first (a ValueError leaves every rank unchanged), then each
batch of the plan goes to every rank through ``collective_rpc``; rank 0 broadcasts the tensors."""

import torch

UPDATE_BATCH = 256  # plan entries per call: a few tens of KB through the control channel
WHERE = " given to update_weights"


def _helpers():
    from nanovllm.utils import weights

    return weights


def plan_rank(runner, tensors: list[tuple[str, tuple, bool]]):
    """Where each ``(name, shape, is float8)`` goes (``WeightEntry`` list), or the ValueError
    that refuses them (returned, not raised: a worker's loop must go on)."""
    w = _helpers()
    try:
        entries = w.plan_weights(runner.model, [t[:2] for t in tensors], WHERE)
        fp8_names = {e.name for e in entries if tensors[e.index][2]}
        return w.check_fp8_tensors(runner.model, entries, fp8_names, WHERE)
    except ValueError as e:
        return e


@torch.no_grad()
def load_rank(runner, entries: list, tensors: list[torch.Tensor] | None = None) -> None:
    """Copy planned tensors into the parameters in place, each rank its shard. Rank 0 has the
    ``tensors``; with tensor parallelism it broadcasts each (float8 as bytes, else in the
    parameter's dtype, float32 for an FP8 parameter) and the others receive it."""
    w = _helpers()
    params = dict(runner.model.named_parameters(remove_duplicate=False))
    for i, entry in enumerate(entries):
        param = params[entry.target]
        tensor = None if tensors is None else tensors[i]
        if runner.world_size > 1:
            import torch.distributed as dist

            dtype = param.dtype
            if dtype == torch.float8_e4m3fn and not entry.fp8:
                dtype = torch.float32
            if tensor is None:
                tensor = torch.empty(entry.shape, dtype=dtype, device=runner.device)
            else:
                tensor = tensor.to(runner.device, dtype).contiguous()
            dist.broadcast(tensor.view(torch.uint8) if entry.fp8 else tensor, 0)  # gloo: no fp8
        w.copy_weight(param, entry, tensor, WHERE)
    runner.sync()


def update_weights(engine, weights) -> None:
    """Copy ``(checkpoint name, tensor)`` pairs (or a mapping) into the model on every rank and
    replica, then drop the prefix cache. All or nothing: every tensor is checked before any is
    written. Only between requests (``engine.check_idle``)."""
    from nanovllm.runner.model_runner import RankZeroOnly

    named = _helpers().named_tensors(weights)
    engine.check_idle("update_weights")
    if engine.config.data_parallel_size > 1 or engine.config.data_parallel_backend == "ray":
        named = [(name, tensor.cpu()) for name, tensor in named]  # pickled to each replica
    core = engine.core
    described = [(n, tuple(t.shape), t.dtype == torch.float8_e4m3fn) for n, t in named]
    entries = core.collective_rpc(plan_rank, (described,))[0]
    if isinstance(entries, ValueError):
        raise entries
    for start in range(0, len(entries), UPDATE_BATCH):
        batch = entries[start : start + UPDATE_BATCH]
        tensors = [named[entry.index][1] for entry in batch]
        core.collective_rpc(load_rank, (batch, RankZeroOnly(tensors)))
    core.reset_prefix_cache()
