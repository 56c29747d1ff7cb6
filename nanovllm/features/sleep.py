import logging
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.features.idle import check_idle
from nanovllm.layers.attention import Attention

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)
TAGS = ("weights", "kv_cache")  # what wake_up(tags) restores
MODES = ("abort", "wait", "keep")  # what sleep(mode) does to queued requests


@dataclass
class Offloaded:
    """One storage and the parameters and buffers viewing it (a LoRA layer's weight and its
    adapters share one): ``views`` holds (tensor, shape, stride, offset, dtype)."""

    views: list[tuple[torch.Tensor, torch.Size, tuple[int, ...], int, torch.dtype]]
    nbytes: int
    host: torch.Tensor | None  # the storage's bytes


class HostArena:
    """One pinned host buffer for level 1's weights, reused between sleeps."""

    ALIGN = 256  # bytes: every tensor's slice starts aligned for any dtype

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = None  # the old one goes before the new one is pinned
            self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        out = []
        for t, offset in zip(tensors, offsets):
            host = (
                self.buffer[offset : offset + t.numel() * t.element_size()]
                .view(t.dtype)
                .view(t.shape)
            )
            out.append(host.copy_(t, non_blocking=True))
        torch.cuda.synchronize()
        return out


def _bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


@torch.no_grad()
def offload(model: nn.Module, level: int, arena: HostArena) -> list[Offloaded]:
    """Empty every parameter and buffer in place, a storage at a time; host copies of the
    storages of buffers and (level 1) weights."""
    kept = [(p, level == 1) for p in model.parameters()] + [(b, True) for b in model.buffers()]
    groups: dict[int, tuple[torch.UntypedStorage, list, list[bool]]] = {}
    for t, keep in kept:
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else -id(t)
        group = groups.setdefault(key, (storage, [], []))
        group[1].append((t, t.shape, t.stride(), t.storage_offset(), t.dtype))
        group[2].append(keep)
    groups = list(groups.values())
    # every host copy first: if host memory runs out, the model is still whole
    to_copy = [_bytes(s, views[0][0].device) for s, views, keep in groups if any(keep)]
    if to_copy and to_copy[0].device.type != "cpu":
        to_copy = arena.copies(to_copy)
    hosts = iter(to_copy)  # on the CPU a storage is its own host copy
    out = [
        Offloaded(views, storage.nbytes(), next(hosts) if any(keep) else None)
        for storage, views, keep in groups
    ]
    for entry in out:
        for t, *_, dtype in entry.views:
            t.data = torch.empty(0, dtype=dtype, device=t.device)
    return out


@torch.no_grad()
def restore(offloaded: list[Offloaded], device: torch.device) -> None:
    for entry in offloaded:
        if entry.host is not None and entry.host.device == device:  # the CPU: its own storage again
            data = entry.host
        else:
            data = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
            if entry.host is None:
                data.zero_()
            else:
                data.copy_(entry.host)
        storage = data.untyped_storage()
        for t, shape, stride, offset, dtype in entry.views:
            t.data = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


def check_level(level) -> int:
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(
            f"sleep level must be an int (1 or 2), got {level!r} ({type(level).__name__})"
        )
    if level not in SLEEP_LEVELS:
        raise ValueError(
            f"sleep level must be 1 (weights kept on the host) or 2 (weights dropped), got {level}"
            + (" (level 0, pausing the scheduler, is not supported here)" if level == 0 else "")
        )
    return level


def log_device_memory(device: torch.device, what: str) -> None:
    if device.type == "cuda" and logger.isEnabledFor(logging.DEBUG):
        mib = 2**20
        logger.debug(
            "%s: %.1f MiB allocated, %.1f MiB reserved on %s",
            what,
            torch.cuda.memory_allocated(device) / mib,
            torch.cuda.memory_reserved(device) / mib,
            device,
        )


def free_cache(runner) -> None:
    """Free what ``ModelRunner.allocate_cache`` made, between steps."""
    runner.sync()
    runner.graphs = None
    for module in runner.model.modules():
        if isinstance(module, Attention):
            module.k_cache = module.v_cache = torch.tensor([])
            module.k_scale = module.v_scale = None
    runner.kv_cache = runner.sampled = runner.decode_buffer = None
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()


def sleep_rank(runner, level: int) -> None:
    runner.sync()
    if getattr(runner, "host_arena", None) is None:
        runner.host_arena = HostArena()
    runner.offloaded = offload(runner.model, level, runner.host_arena)
    free_cache(runner)
    log_device_memory(runner.device, f"rank {runner.rank} asleep (level {level})")


def wake_rank(runner, tags: tuple[str, ...] = TAGS) -> None:
    """Short of memory it raises, and what it could not restore stays asleep."""
    if "weights" in tags and runner.offloaded is not None:
        restore(runner.offloaded, runner.device)
        runner.offloaded = None
        if runner.kv_cache is not None and not runner.enforce_eager:  # captured without weights
            runner.graphs = runner.capture_graphs()
    if "kv_cache" in tags and runner.kv_cache is None:
        if runner.offloaded is None:
            runner.allocate_cache()
        else:  # CUDA graphs wait for the weights
            runner._build_buffers()
            runner.kv_cache = runner.bind_kv_cache(runner.num_kvcache_blocks)
    log_device_memory(runner.device, f"rank {runner.rank} awake ({', '.join(tags)})")


def _check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"sleep mode must be one of {MODES}, got {mode!r}")
    return mode


def _settle_requests(engine, mode: str) -> None:
    """``mode`` applied to queued requests: aborted, finished first, or kept to recompute."""
    from nanovllm.entrypoints.step_loop import abort_request

    if engine._owned and not engine.core.is_finished():
        check_idle(engine, "sleep")  # a generate/stream call of this LLM is being read
    if mode == "abort":
        for request_id in [r for r in engine.outputs.requests if r not in engine._owned]:
            abort_request(engine, request_id)
        check_idle(engine, "sleep")  # replicas: what is left is an error
    elif mode == "wait":
        while not engine.core.is_finished():
            engine._step()
    elif not engine.core.is_finished():  # keep: the KV cache goes, so they start again
        if not hasattr(engine.core, "scheduler"):
            raise ValueError("sleep mode 'keep' needs one engine core (data_parallel_size 1)")
        if engine.core._launched is not None:
            engine._process(engine.core._resolve())
        scheduler = engine.core.scheduler
        for seq in list(scheduler.waiting)[:1]:  # a chunked prefill in progress holds blocks
            scheduler.block_manager.deallocate(seq)
        for seq in reversed(scheduler.running):
            scheduler.preempt(seq, count=False)
        scheduler.running.clear()


def sleep(engine, level: int = 1, mode: str = "abort") -> None:
    """Free device memory on every rank (level 1 keeps the weights on the host; 2 drops them);
    ``mode``: what happens to queued requests (``abort``, ``wait`` for them, ``keep`` them)."""
    engine._check_running(asleep_ok=True)
    if not engine.config.enable_sleep_mode:
        raise RuntimeError("sleep() needs sleep mode: create the LLM with enable_sleep_mode=True")
    level, mode = check_level(level), _check_mode(mode)
    if engine.sleep_level:
        raise RuntimeError(
            f"the engine is already asleep (level {engine.sleep_level}); call wake_up() first"
        )
    _settle_requests(engine, mode)
    engine.core.collective_rpc(sleep_rank, (level,))
    engine.sleep_level, engine.asleep_tags = level, set(TAGS)
    engine.core.reset_prefix_cache()


def _check_tags(tags) -> tuple[str, ...]:
    if tags is None:
        return TAGS
    if isinstance(tags, str) or not all(t in (*TAGS, "scheduling") for t in tags):
        raise ValueError(
            f"wake_up tags must be None (everything) or a list of {(*TAGS, 'scheduling')}, "
            f"got {tags!r}"
        )
    return tuple(t for t in TAGS if t in tags)


def wake_up(engine, tags: list[str] | None = None) -> bool:
    """Reallocate what ``sleep`` freed (``tags``: only the weights, or only the KV cache);
    True once the engine is fully awake. A no-op while awake."""
    engine._check_running(asleep_ok=True)
    tags = _check_tags(tags)
    if engine.sleep_level:
        todo = tuple(t for t in tags if t in engine.asleep_tags)
        if todo:
            engine.core.collective_rpc(wake_rank, (todo,))
            engine.asleep_tags.difference_update(todo)
        if not engine.asleep_tags:
            engine.sleep_level = 0
    return engine.sleep_level == 0


def weights_awake(engine) -> None:
    """For calls that change the weights: the engine awake, or asleep with its weights back."""
    engine._check_running(asleep_ok=True)
    if engine.sleep_level and "weights" in engine.asleep_tags:
        engine._check_running()


def is_sleeping(engine) -> bool:
    return engine.sleep_level != 0
