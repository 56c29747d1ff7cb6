import logging
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.features.idle import check_idle
from nanovllm.layers.attention import Attention

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)


@dataclass
class Offloaded:
    tensor: torch.Tensor
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    host: torch.Tensor | None


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


@torch.no_grad()
def offload(model: nn.Module, level: int, arena: HostArena) -> list[Offloaded]:
    """Empty every parameter and buffer in place; host copies of buffers and (level 1) weights."""
    kept = [(p, level == 1) for p in model.parameters()] + [(b, True) for b in model.buffers()]
    # every host copy first: if host memory runs out, the model is still whole
    to_copy = [t.data for t, keep in kept if keep]
    if to_copy and to_copy[0].device.type != "cpu":
        to_copy = arena.copies(to_copy)
    hosts = iter(to_copy)  # on the CPU a tensor's own storage is its host copy
    out = [
        Offloaded(t, t.shape, t.stride(), t.dtype, next(hosts) if keep else None)
        for t, keep in kept
    ]
    for entry in out:
        entry.tensor.data = torch.empty(0, dtype=entry.dtype, device=entry.tensor.device)
    return out


@torch.no_grad()
def restore(offloaded: list[Offloaded], device: torch.device) -> None:
    for entry in offloaded:
        if entry.host is not None and entry.host.device == device:  # the CPU: its own storage again
            data = entry.host
        else:
            data = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype, device=device)
            if entry.host is None:
                data.zero_()
            else:
                data.copy_(entry.host)
        entry.tensor.data = data


def check_level(level) -> int:
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(
            f"sleep level must be an int (1 or 2), got {level!r} ({type(level).__name__})"
        )
    if level not in SLEEP_LEVELS:
        raise ValueError(
            f"sleep level must be 1 (weights kept on the host) or 2 (weights dropped), got {level}"
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


def wake_rank(runner) -> None:
    """Short of memory it raises, and the rank stays asleep."""
    restore(runner.offloaded, runner.device)
    runner.allocate_cache()
    runner.offloaded = None
    log_device_memory(runner.device, f"rank {runner.rank} awake")


def sleep(engine, level: int = 1) -> None:
    """Free device memory on every rank (level 1 keeps the weights on the host; 2 drops them)."""
    engine._check_running(asleep_ok=True)
    if not engine.config.enable_sleep_mode:
        raise RuntimeError("sleep() needs sleep mode: create the LLM with enable_sleep_mode=True")
    level = check_level(level)
    if engine.sleep_level:
        raise RuntimeError(
            f"the engine is already asleep (level {engine.sleep_level}); call wake_up() first"
        )
    check_idle(engine, "sleep")
    engine.core.collective_rpc(sleep_rank, (level,))
    engine.sleep_level = level
    engine.core.reset_prefix_cache()


def wake_up(engine) -> None:
    """Reallocate what ``sleep`` freed; a no-op while awake."""
    engine._check_running(asleep_ok=True)
    if engine.sleep_level:
        engine.core.collective_rpc(wake_rank)
        engine.sleep_level = 0


def is_sleeping(engine) -> bool:
    return engine.sleep_level != 0
