"""A one-shot all-reduce for tensor parallelism on one host, launched only inside CUDA graphs:
each rank writes its tensor into every peer's buffer and sums, in rank order and in float32, as
the peers' elements arrive (-0.0 marks an element not yet written). ``abort()`` frees every wait
when a peer died. Design notes: docs/parallel.md."""

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

BLOCK = 1024  # elements a program sums at a time
PROGRAMS = (
    256  # the most programs of a call: few enough to be resident at once on any GPU it runs on
)
MAX_BYTES = 8 << 20  # the largest tensor it takes; NCCL sums larger ones
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
POLL_ABORT_EVERY = 1 << 14  # spins between two reads of the abort flag
NUM_WARPS = 4  # per program
TL_INT = {torch.int16: tl.int16, torch.int32: tl.int32}


@triton.jit
def next_epoch(epochs, COUNTERS: tl.constexpr):
    """This call's epoch (the calls so far, plus one), advancing this program's share of the
    counters: program ``p`` of ``P`` reads counter ``p`` and stores ``p, p + P, ...``."""
    pid = tl.program_id(0)
    epoch = tl.load(epochs + pid) + 1  # every thread reads the count; one thread stores it
    # no warp may read the count after it moved on (its waits would never end)
    tl.debug_barrier()
    for c in range(pid, COUNTERS, tl.num_programs(0)):  # no other program reads these in this call
        tl.store(epochs + c, epoch)
    return epoch


@triton.jit
def buffer(data_ptrs, r, BITS: tl.constexpr):
    """Rank r's buffer as integers of ``BITS``, aligned (so that accesses go 16 bytes at a time:
    the compiler cannot see the alignment of an address it loads)."""
    return tl.multiple_of(tl.load(data_ptrs + r).to(tl.pointer_type(BITS)), 16)


@triton.jit
def push(
    x_ptr,
    offs,
    mask,
    data_ptrs,
    half,
    rank,
    slot,
    WORLD: tl.constexpr,
    BITS: tl.constexpr,
    SENTINEL: tl.constexpr,
):
    """Store x's elements at ``offs`` into this rank's slot of every other rank's buffer (``half``:
    the call's half of each; ``BITS``: integers of the dtype's width), -0.0 as +0.0."""
    v = tl.load(x_ptr + offs, mask=mask).to(BITS, bitcast=True)
    v = tl.where(v == SENTINEL, tl.zeros_like(v), v)  # the sentinel never leaves a rank
    for r in tl.static_range(WORLD):
        if r != rank:
            tl.store(buffer(data_ptrs, r, BITS) + half + rank * slot + offs, v, mask=mask)


@triton.jit
def take(own, r, offs, mask, slot, abort_flag, SENTINEL: tl.constexpr, POLL: tl.constexpr):
    """Rank r's elements at ``offs`` in this rank's buffer (``own``: the call's half, as integers
    of the dtype's width), once none is the sentinel (or the abort flag is up); the sentinel goes
    back in their place."""
    ptr = own + r * slot + offs
    bits = tl.load(ptr, mask=mask, other=0, volatile=True)  # past L1, where the peers' writes land
    missing = tl.sum((bits == SENTINEL).to(tl.int32), axis=0)
    spins = 0
    while missing > 0:
        spins += 1
        bits = tl.load(ptr, mask=mask, other=0, volatile=True)
        missing = tl.sum((bits == SENTINEL).to(tl.int32), axis=0)
        if spins % POLL == 0:  # (host memory: volatile reads see the host's store)
            if tl.load(abort_flag, volatile=True) != 0:
                missing = 0
    tl.store(ptr, tl.full(bits.shape, SENTINEL, bits.dtype), mask=mask)
    return bits


@triton.jit
def sum_ranks(
    x_ptr,
    own,
    offs,
    mask,
    rank,
    slot,
    abort_flag,
    WORLD: tl.constexpr,
    SENTINEL: tl.constexpr,
    POLL: tl.constexpr,
):
    """The sum at ``offs`` over the ranks (this rank's from x, the others' from their slots of
    ``own``, as ``take`` gives them), in rank order, in float32."""
    mine = tl.load(x_ptr + offs, mask=mask, other=0.0)
    for r in tl.static_range(WORLD):
        value = mine
        if r != rank:
            value = take(own, r, offs, mask, slot, abort_flag, SENTINEL, POLL).to(
                mine.dtype, bitcast=True
            )
        if r == 0:
            acc = value.to(tl.float32)
        else:
            acc += value.to(tl.float32)
    return acc


@triton.jit(
    do_not_specialize=["rank"]
)  # (n: a multiple of 16 lets the masked accesses go 16 bytes at a time)
def _one_shot_kernel(
    x_ptr,
    n,
    data_ptrs,
    epochs,
    abort_flag,
    rank,
    slot,
    WORLD: tl.constexpr,
    COUNTERS: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    SENTINEL: tl.constexpr,
    POLL: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = next_epoch(epochs, COUNTERS)
    num_blocks = tl.cdiv(n, BLOCK)
    half = (epoch % 2) * WORLD * slot  # the call's half of every buffer: one slot per rank
    for b in range(pid, num_blocks, programs):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        push(x_ptr, offs, offs < n, data_ptrs, half, rank, slot, WORLD, BITS, SENTINEL)
    own = buffer(data_ptrs, rank, BITS) + half
    for b in range(pid, num_blocks, programs):  # all local
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        total = sum_ranks(x_ptr, own, offs, mask, rank, slot, abort_flag, WORLD, SENTINEL, POLL)
        tl.store(x_ptr + offs, total.to(x_ptr.dtype.element_ty), mask=mask)


def sentinel(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """The integer dtype of ``dtype``'s width and the bits of its -0.0 in it: what an element of a
    buffer slot holds until a peer writes it."""
    bits = torch.finfo(dtype).bits
    return {16: torch.int16, 32: torch.int32}[bits], -(1 << (bits - 1))


def launch(
    x: torch.Tensor,
    data_ptrs: torch.Tensor,
    epochs: torch.Tensor,
    abort_flag: torch.Tensor,
    rank: int,
    world: int,
    slot: int,
    poll: int = POLL_ABORT_EVERY,
) -> None:
    """Sum ``x`` (contiguous, at most ``slot`` elements) in place over the ranks whose buffers (two
    halves of ``world`` slots of ``slot`` elements of x's dtype, each element the sentinel until
    written) the int64 ``data_ptrs`` address; ``epochs`` (int64 counters, as many as a call may run
    programs) counts the calls, and a nonzero int32 ``abort_flag`` (pinned host memory on a GPU)
    ends the waits, read every ``poll`` spins."""
    counters = epochs.numel()
    programs = min(counters, triton.cdiv(x.numel(), BLOCK))
    bits, value = sentinel(x.dtype)
    _one_shot_kernel[(programs,)](
        x,
        x.numel(),
        data_ptrs,
        epochs,
        abort_flag,
        rank,
        slot,
        WORLD=world,
        COUNTERS=counters,
        BLOCK=BLOCK,
        BITS=TL_INT[bits],
        SENTINEL=value,
        POLL=poll,
        num_warps=NUM_WARPS,
    )


class CustomAllReduce:
    """The one-shot all-reduce of this rank's tensor-parallel group for tensors of ``dtype`` (every
    rank constructs it together). ``fits(x)`` says whether it takes ``x``; ``__call__(x)`` sums it
    in place."""

    def __init__(
        self, device: torch.device, rank: int, world: int, group_name: str, dtype: torch.dtype
    ):
        import torch.distributed._symmetric_memory as symm_mem

        if dtype not in DTYPES:
            raise ValueError(f"the one-shot all-reduce sums {DTYPES}, not {dtype}")
        os.environ.setdefault(
            "TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"
        )  # nothing here uses multicast
        self.rank, self.world, self.dtype = rank, world, dtype
        self.data = symm_mem.empty(
            2 * world * MAX_BYTES, dtype=torch.uint8, device=device
        )  # 2 halves x world slots
        bits, value = sentinel(dtype)
        self.data.view(bits).fill_(value)
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(self.data, group_name)
        self.data_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self._handle = handle
        self.epochs = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)
        self.abort_flag = torch.zeros(
            1, dtype=torch.int32, pin_memory=True
        )  # read by the GPU, written here
        dist.barrier()  # every rank's buffer holds the sentinel before anyone writes into it
        for n in (
            1,
            16,
            17,
        ):  # compile and load the kernel's variants now, not while a graph is captured
            self(torch.zeros(n, dtype=dtype, device=device))
        torch.cuda.synchronize(device)

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.is_cuda
            and x.dtype == self.dtype
            and x.is_contiguous()
            and x.numel() > 0
            and x.numel() * x.element_size() <= MAX_BYTES
        )

    def slot(self, x: torch.Tensor) -> int:
        """Elements of x's dtype in one rank's slot of a buffer half."""
        return MAX_BYTES // x.element_size()

    def __call__(self, x: torch.Tensor) -> None:
        if not self.fits(x):  # (another dtype's elements would never look like this one's sentinel)
            raise ValueError(
                f"the one-shot all-reduce takes contiguous CUDA tensors of {self.dtype} up to "
                f"{MAX_BYTES} bytes, not {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        launch(x, self.data_ptrs, self.epochs, self.abort_flag, self.rank, self.world, self.slot(x))

    def abort(self) -> None:
        """Let every wait of a running or queued call give up (its sums are then garbage from here
        on): a store into host memory, safe from any thread."""
        self.abort_flag.fill_(1)
