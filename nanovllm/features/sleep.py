"""Sleep mode: free the engine's device memory between requests, and take it back.

``sleep(engine, level)`` and ``wake_up(engine)`` are the front end's calls; each rank runs
``sleep_rank`` / ``wake_rank`` through ``collective_rpc``. ``offload`` empties every parameter and
buffer in place (each keeps its object, only ``.data`` changes): level 1 keeps the weights on the
host, level 2 drops them (they come back zero-filled); buffers are kept at both levels.
"""

import logging
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)


@dataclass
class Offloaded:
    """One emptied tensor, how to rebuild it, and its host values (None: dropped)."""

    tensor: torch.Tensor
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    host: torch.Tensor | None


class HostArena:
    """One pinned host buffer for level 1's weights on a GPU, kept from one sleep to the next
    (pinning is slow; copying into pinned memory is fast)."""

    ALIGN = 256  # bytes: every tensor's slice starts aligned for any dtype

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """A host copy of each (device) tensor, in slices of the buffer (grown when too small)."""
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
    """Empty every parameter and buffer of ``model`` (each shared one once), keeping host copies
    as the level says (in ``arena`` on a GPU; on the CPU a tensor's storage is its own copy)."""
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
    """Give each emptied tensor its memory back on ``device``, with its host values if any."""
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
    """``sleep``'s level: 1 (weights kept on the host) or 2 (weights dropped)."""
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
    """At debug level: what torch holds on the GPU after ``what``."""
    if device.type == "cuda" and logger.isEnabledFor(logging.DEBUG):
        mib = 2**20
        logger.debug(
            "%s: %.1f MiB allocated, %.1f MiB reserved on %s",
            what,
            torch.cuda.memory_allocated(device) / mib,
            torch.cuda.memory_reserved(device) / mib,
            device,
        )


def sleep_rank(runner, level: int) -> None:
    """Free this rank's CUDA graphs, KV cache, step buffers and model tensors. Between steps."""
    runner.sync()
    if getattr(runner, "host_arena", None) is None:
        runner.host_arena = HostArena()
    runner.offloaded = offload(runner.model, level, runner.host_arena)
    runner.free_cache()
    log_device_memory(runner.device, f"rank {runner.rank} asleep (level {level})")


def wake_rank(runner) -> None:
    """Reallocate what ``sleep_rank`` freed (the KV cache with as many blocks as before). Short of
    memory it raises, and stays asleep."""
    restore(runner.offloaded, runner.device)
    runner.allocate_cache()
    runner.offloaded = None
    log_device_memory(runner.device, f"rank {runner.rank} awake")


def sleep(engine, level: int) -> None:
    """Free the KV cache, the CUDA graphs and the weights on every rank and replica (level 1:
    weights kept on the host; 2: dropped), and drop the prefix cache. Needs
    ``enable_sleep_mode=True``, an awake engine and nothing queued (else a RuntimeError)."""
    if not engine.config.enable_sleep_mode:
        raise RuntimeError("sleep() needs sleep mode: create the LLM with enable_sleep_mode=True")
    level = check_level(level)
    if engine.sleep_level:
        raise RuntimeError(
            f"the engine is already asleep (level {engine.sleep_level}); call wake_up() first"
        )
    engine.check_idle("sleep")
    engine.core.collective_rpc(sleep_rank, (level,))
    engine.sleep_level = level
    engine.core.reset_prefix_cache()


def wake_up(engine) -> None:
    """Reallocate what ``sleep`` freed (a no-op while awake)."""
    if engine.sleep_level:
        engine.core.collective_rpc(wake_rank)
        engine.sleep_level = 0
