"""A one-shot all-reduce for tensor parallelism on one host: the small sums of a decode step in one
kernel, where NCCL spends much of its time in latency.

Every rank holds a buffer that the other ranks of the host map (torch's symmetric memory over
CUDA IPC, without NVLink multicast), with a slot for every rank. A call writes this rank's tensor
into its slot of every rank's buffer (the only traffic between GPUs: writes, which need no round
trip and were measured faster than reads), tells every rank that its part is there, waits until
every rank has said the same, and sums the slots of its own buffer in rank order (in float32), so
every rank computes exactly the same values.

A call runs one program per block of ``BLOCK`` elements, at most ``PROGRAMS`` (few enough to be
resident at once: a program that waits for its peer must not keep that peer's counterpart from being
scheduled), so a small tensor's call is a few programs with a handshake each; program ``p`` of ``P``
handles blocks ``p, p + P, ...`` on every rank (every rank runs the same ``P`` for the same size), so
the handshake is per program: rank ``r`` writes epoch ``e`` into slot ``(p, r)`` of every rank's
flags once its blocks are written, and its peers' programs ``p`` wait for it there. The epoch counts
the calls on the device (CUDA graphs replay the same arguments): ``PROGRAMS`` counters all hold it,
program ``p`` reads counter ``p`` and advances counters ``p, p + P, ...``, so every counter moves on
every call whatever ``P`` is. The buffers alternate between two halves by the epoch's parity: a rank
whose programs saw their peers' epoch ``e`` knows the peers have finished the call before (a kernel
starts after the previous one ends), so their sums of epoch ``e - 1`` are over and epoch ``e + 1``
may write that half again.

A spinning kernel never ends if a peer dies; ``abort()`` raises a flag that the waits poll, so the
device drains and the engine can report the failure. The flag lives in pinned host memory and is
raised by a plain store from any thread, with no CUDA call: a copy into device memory (tried first)
never ran while the kernels spun, queued behind work that waited on them, and a thread blocked in a
CUDA call that waits for the device (eager mode loading a kernel) is freed only this way. A wait
reads the flag once every ``POLL_ABORT_EVERY`` spins, so a call whose peers come in time never
reads host memory (polled every 64 spins, it had stalled calls by ~0.6 ms).

Torch pairs the ranks' symmetric-memory set-ups by a count kept per process, so a process sets the
kernel up once: a later engine in the same process (whose other ranks are new processes) sums with
NCCL (``distributed.enable_custom_all_reduce``).

Only CUDA graphs launch it (``distributed.all_reduce``): eagerly, a spinning call would sit between
host work that may wait for the device. It is off by default (``Config.disable_custom_all_reduce``):
it sums 8 KiB-4 MiB faster than NCCL and a Qwen3-8B benchmark at TP=2 ~3% (2 × H100) to ~5%
(2 × H200) faster, but the test that kills a worker under it has not passed yet (BENCHMARKS.md)."""
import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

BLOCK = 1024  # elements a program sums at a time
PROGRAMS = 256  # the most programs of a call: few enough to be resident at once on any GPU it runs on
MAX_BYTES = 8 << 20  # the largest tensor it takes; NCCL sums larger ones
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
POLL_ABORT_EVERY = 1 << 14  # spins between two reads of the abort flag
NUM_WARPS = 4  # per program


@triton.jit
def next_epoch(epochs, COUNTERS: tl.constexpr):
    """This call's epoch (the calls so far, plus one), advancing this program's share of the
    counters: program ``p`` of ``P`` reads counter ``p`` and stores ``p, p + P, ...``."""
    pid = tl.program_id(0)
    epoch = tl.load(epochs + pid) + 1  # every thread reads the count; one thread stores it
    tl.debug_barrier()  # so no warp may read the count after it moved on (its waits would never end)
    for c in range(pid, COUNTERS, tl.num_programs(0)):  # no other program reads these in this call
        tl.store(epochs + c, epoch)
    return epoch


@triton.jit
def signal_and_wait(flag_ptrs, abort_flag, rank, epoch, WORLD: tl.constexpr, POLL: tl.constexpr):
    """Tell every rank that this program's part of the call is in its buffer, then wait until
    every rank has said the same to this one (or the abort flag is up)."""
    pid = tl.program_id(0)
    tl.debug_barrier()  # the program's writes are done before the signal releases them
    for r in tl.static_range(WORLD):
        peer_flags = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(peer_flags + pid * WORLD + rank, epoch, sem="release", scope="sys")
    flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int64))
    for r in tl.static_range(WORLD):  # spin on plain reads, then one acquire orders what follows
        signal = flags + pid * WORLD + r
        spins = 0
        seen = tl.load(signal, volatile=True)
        while seen < epoch:
            spins += 1
            seen = tl.load(signal, volatile=True)
            if spins % POLL == 0:  # (host memory: volatile reads see the host's store)
                if tl.load(abort_flag, volatile=True) != 0:
                    seen = epoch
        tl.atomic_add(signal, 0, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def push(x_ptr, offs, mask, data_ptrs, half, rank, slot, WORLD: tl.constexpr):
    """Store x's elements at ``offs`` into this rank's slot of every rank's buffer (``half``: the
    call's half of each)."""
    v = tl.load(x_ptr + offs, mask=mask)
    for r in tl.static_range(WORLD):
        dst = tl.load(data_ptrs + r).to(tl.pointer_type(x_ptr.dtype.element_ty))
        tl.store(dst + half + rank * slot + offs, v, mask=mask)


@triton.jit
def sum_slots(own, offs, mask, slot, WORLD: tl.constexpr):
    """The sum at ``offs`` over the ranks' slots of this rank's buffer (``own``: the call's half), in
    rank order, in float32. The loads go past L1 (.cg), which the peers' writes do not reach."""
    acc = tl.load(own + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    for r in tl.static_range(1, WORLD):
        acc += tl.load(own + r * slot + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["n", "rank"])
def _one_shot_kernel(x_ptr, n, data_ptrs, flag_ptrs, epochs, abort_flag, rank, slot,
                     WORLD: tl.constexpr, COUNTERS: tl.constexpr, BLOCK: tl.constexpr, POLL: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = next_epoch(epochs, COUNTERS)
    num_blocks = tl.cdiv(n, BLOCK)
    half = (epoch % 2) * WORLD * slot  # the call's half of every buffer: one slot per rank
    elem = x_ptr.dtype.element_ty
    for b in range(pid, num_blocks, programs):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        push(x_ptr, offs, offs < n, data_ptrs, half, rank, slot, WORLD)
    signal_and_wait(flag_ptrs, abort_flag, rank, epoch, WORLD, POLL)
    own = tl.load(data_ptrs + rank).to(tl.pointer_type(elem)) + half
    for b in range(pid, num_blocks, programs):  # all local
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, sum_slots(own, offs, mask, slot, WORLD).to(elem), mask=mask)


def launch(x: torch.Tensor, data_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, epochs: torch.Tensor,
           abort_flag: torch.Tensor, rank: int, world: int, slot: int, poll: int = POLL_ABORT_EVERY) -> None:
    """Sum ``x`` (contiguous, at most ``slot`` elements) in place over the ranks whose buffers
    (two halves of ``world`` slots of ``slot`` elements of x's dtype) and int64 flags (``world``
    per counter) the int64 ``data_ptrs`` / ``flag_ptrs`` address; ``epochs`` (int64 counters, as
    many as a call may run programs) counts the calls, and a nonzero int32 ``abort_flag`` (pinned
    host memory on a GPU) ends the waits, read every ``poll`` spins."""
    counters = epochs.numel()
    programs = min(counters, triton.cdiv(x.numel(), BLOCK))
    _one_shot_kernel[(programs,)](x, x.numel(), data_ptrs, flag_ptrs, epochs, abort_flag, rank, slot,
                                  WORLD=world, COUNTERS=counters, BLOCK=BLOCK, POLL=poll, num_warps=NUM_WARPS)


class CustomAllReduce:
    """The one-shot all-reduce of this rank's tensor-parallel group (every rank constructs it
    together). ``fits(x)`` says whether it takes ``x``; ``__call__(x)`` sums it in place."""

    def __init__(self, device: torch.device, rank: int, world: int, group_name: str):
        import torch.distributed._symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # nothing here uses multicast
        self.rank, self.world = rank, world
        self.data = symm_mem.empty(2 * world * MAX_BYTES, dtype=torch.uint8, device=device)  # 2 halves x world slots
        self.flags = symm_mem.empty(PROGRAMS * world, dtype=torch.int64, device=device)
        self.flags.zero_()
        torch.cuda.synchronize(device)
        data_handle = symm_mem.rendezvous(self.data, group_name)
        flag_handle = symm_mem.rendezvous(self.flags, group_name)
        self.data_ptrs = torch.tensor(data_handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(flag_handle.buffer_ptrs, dtype=torch.int64, device=device)
        self._handles = (data_handle, flag_handle)
        self.epochs = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)
        self.abort_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # read by the GPU, written here
        dist.barrier()  # every rank's flags are zero before anyone signals
        self(torch.zeros(1, device=device))  # compile and load the kernel now, not while a graph is captured
        torch.cuda.synchronize(device)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dtype in DTYPES and x.is_contiguous() and x.numel() > 0
                and x.numel() * x.element_size() <= MAX_BYTES)

    def slot(self, x: torch.Tensor) -> int:
        """Elements of x's dtype in one rank's slot of a buffer half."""
        return MAX_BYTES // x.element_size()

    def __call__(self, x: torch.Tensor) -> None:
        launch(x, self.data_ptrs, self.flag_ptrs, self.epochs, self.abort_flag, self.rank, self.world, self.slot(x))

    def abort(self) -> None:
        """Let every wait of a running or queued call give up (its sums are then garbage from here
        on): a store into host memory, safe from any thread."""
        self.abort_flag.fill_(1)
