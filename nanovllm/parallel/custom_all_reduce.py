"""One-shot all-reduce, used only inside CUDA graphs (docs/parallel.md)."""

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

BLOCK = 1024  # elements a program sums at a time
# the most programs of a call: few enough to be resident at once on any GPU it runs on
PROGRAMS = 256
MAX_BYTES = 8 << 20  # the largest tensor it takes; NCCL sums larger ones
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
POLL_ABORT_EVERY = 1 << 14  # spins between two reads of the abort flag
NUM_WARPS = 4  # per program
TL_INT = {torch.int16: tl.int16, torch.int32: tl.int32}


@triton.jit
def next_epoch(epochs, COUNTERS: tl.constexpr):
    """This call's epoch; program p of P reads counter p and stores p, p + P, ..."""
    pid = tl.program_id(0)
    epoch = tl.load(epochs + pid) + 1  # every thread reads the count; one thread stores it
    # no warp may read the count after it moved on (its waits would never end)
    tl.debug_barrier()
    for c in range(pid, COUNTERS, tl.num_programs(0)):  # no other program reads these in this call
        tl.store(epochs + c, epoch)
    return epoch


@triton.jit
def buffer(data_ptrs, r, BITS: tl.constexpr):
    # aligned, so that accesses go 16 bytes at a time
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
    """Store x's elements into this rank's slot of every peer's buffer, -0.0 as +0.0."""
    v = tl.load(x_ptr + offs, mask=mask).to(BITS, bitcast=True)
    v = tl.where(v == SENTINEL, tl.zeros_like(v), v)  # the sentinel never leaves a rank
    for r in tl.static_range(WORLD):
        if r != rank:
            tl.store(buffer(data_ptrs, r, BITS) + half + rank * slot + offs, v, mask=mask)


@triton.jit
def take(own, r, offs, mask, slot, abort_flag, SENTINEL: tl.constexpr, POLL: tl.constexpr):
    """Rank r's elements once none is the sentinel (or on abort); puts the sentinel back."""
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
    # in rank order, in float32: every rank gets the same bits
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


# n stays specialized: a multiple of 16 lets the masked accesses go 16 bytes at a time
@triton.jit(do_not_specialize=["rank"])
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
    """The integer dtype of ``dtype``'s width and its -0.0 (an unwritten element) in it."""
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
    """Sum ``x`` (contiguous, at most ``slot`` elements) in place over the ranks."""
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
    """The group's one-shot all-reduce for ``dtype``; every rank constructs it together."""

    def __init__(
        self, device: torch.device, rank: int, world: int, group_name: str, dtype: torch.dtype
    ):
        import torch.distributed._symmetric_memory as symm_mem

        if dtype not in DTYPES:
            raise ValueError(f"the one-shot all-reduce sums {DTYPES}, not {dtype}")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # no multicast here
        self.rank, self.world, self.dtype = rank, world, dtype
        # 2 halves x world slots
        self.data = symm_mem.empty(2 * world * MAX_BYTES, dtype=torch.uint8, device=device)
        bits, value = sentinel(dtype)
        self.data.view(bits).fill_(value)
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(self.data, group_name)
        self.data_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self._handle = handle
        self.epochs = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)
        # read by the GPU, written here
        self.abort_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        dist.barrier()  # every rank's buffer holds the sentinel before anyone writes into it
        # compile and load the kernel's variants now, not while a graph is captured
        for n in (1, 16, 17):
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
        return MAX_BYTES // x.element_size()

    def __call__(self, x: torch.Tensor) -> None:
        if not self.fits(x):  # (another dtype's elements would never look like this one's sentinel)
            raise ValueError(
                f"the one-shot all-reduce takes contiguous CUDA tensors of {self.dtype} up to "
                f"{MAX_BYTES} bytes, not {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        launch(x, self.data_ptrs, self.epochs, self.abort_flag, self.rank, self.world, self.slot(x))

    def abort(self) -> None:
        """Free every wait (sums are garbage from here on); safe from any thread."""
        self.abort_flag.fill_(1)
