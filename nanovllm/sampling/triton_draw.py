"""The plain draw in one pass over the logits on a GPU: argmax(logits / T + gumbel) per row."""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

BLOCK = 2048  # logits per loop step of a program
CHUNK = 8 * BLOCK  # logits per program


@triton.jit
def _mix32(x):
    # the hash of torch_ops._mix32 on uint32 lanes (products wrap modulo 2**32)
    x = (x ^ (x >> 16)) * 0x45D9F3B
    x = (x ^ (x >> 16)) * 0x45D9F3B
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,
    stride,
    temperatures_ptr,
    seeds_ptr,
    out_ptr,
    part_val_ptr,
    part_id_ptr,
    vocab,
    chunk,
    id_offset,
    NUM_CHUNKS: tl.constexpr,
    TO_PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program: one chunk of one row (ids from id_offset); writes the token, or the chunk's
    # best score and id for _best_of_parts_kernel. grid: (rows, NUM_CHUNKS)
    row = tl.program_id(0)
    part = tl.program_id(1)
    t = tl.load(temperatures_ptr + row)
    if t < 0:  # a row this launch does not sample (a CUDA graph's padding, or sampled elsewhere)
        return
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32) + id_offset
    lo = part * chunk
    hi = tl.minimum(lo + chunk, vocab)
    for start in range(lo, hi, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        mask = ids < hi
        x = tl.load(
            logits_ptr + row.to(tl.int64) * stride + ids, mask=mask, other=float("-inf")
        ).to(tl.float32)
        token_ids = ids + id_offset  # the noise and the answer are the vocabulary's ids
        if t > 0:
            bits = _mix32(_mix32(token_ids.to(tl.uint32)) ^ seed)
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            x = x / t - tl.log(-tl.log(u))
            x = tl.where(mask, x, float("-inf"))
        better = x > best  # strict: each lane keeps its first maximum
        best = tl.where(better, x, best)
        best_id = tl.where(better, token_ids, best_id)
    top = tl.max(best, axis=0)
    first = tl.min(
        tl.where(best == top, best_id, id_offset + vocab), axis=0
    )  # the lowest id among equal maxima
    if NUM_CHUNKS == 1 and not TO_PARTS:
        tl.store(out_ptr + row, first.to(tl.int64))
    else:
        tl.store(part_val_ptr + row * NUM_CHUNKS + part, top)
        tl.store(part_id_ptr + row * NUM_CHUNKS + part, first)


@triton.jit
def _best_of_parts_kernel(
    temperatures_ptr,
    out_ptr,
    part_val_ptr,
    part_id_ptr,
    group_stride,
    no_id,
    NUM_PARTS: tl.constexpr,
    GROUPS: tl.constexpr,
    PARTS_PAD: tl.constexpr,
):
    # each row's token: the best of its parts' winners, the lowest id among equals. grid: (rows,)
    row = tl.program_id(0)
    if tl.load(temperatures_ptr + row) < 0:
        return
    parts = tl.arange(0, PARTS_PAD)
    mask = parts < GROUPS * NUM_PARTS
    offs = (parts // NUM_PARTS) * group_stride + row * NUM_PARTS + parts % NUM_PARTS
    val = tl.load(part_val_ptr + offs, mask=mask, other=float("-inf"))
    ids = tl.load(part_id_ptr + offs, mask=mask, other=no_id)
    top = tl.max(val, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(val == top, ids, no_id), axis=0).to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    out: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Token ids into ``out`` [rows] int64; T = 0: argmax, T < 0: the row is skipped. ``chunk``:
    logits per program; by default CHUNK, halved down to BLOCK while fewer than 128 programs
    would run (at batch 1 a row is 75 programs, not 10)."""
    rows, vocab = logits.shape
    if chunk is None:
        chunk = CHUNK
        while chunk > BLOCK and rows * triton.cdiv(vocab, chunk) < 128:
            chunk //= 2
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    if triton.cdiv(vocab, chunk) == 1:
        _check(logits, temperatures, seeds, chunk)
        _gumbel_argmax_kernel[(rows, 1)](
            logits,
            logits.stride(0),
            temperatures,
            seeds,
            out,
            out,
            out,
            vocab,
            chunk,
            0,
            NUM_CHUNKS=1,
            TO_PARTS=False,
            BLOCK=BLOCK,
            num_warps=8,
        )
        return out
    return best_of_parts(
        gumbel_parts(logits, temperatures, seeds, 0, chunk)[None], temperatures, vocab, out
    )


def gumbel_parts(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    vocab_start: int,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """Each chunk's best score bits and id, int32 [2, rows, chunks], ids from ``vocab_start``."""
    _check(logits, temperatures, seeds, chunk)
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, chunk)
    parts = torch.empty(2, rows, num_chunks, dtype=torch.int32, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows, num_chunks)](
            logits,
            logits.stride(0),
            temperatures,
            seeds,
            parts,
            parts[0].view(torch.float32),
            parts[1],
            vocab,
            chunk,
            vocab_start,
            NUM_CHUNKS=num_chunks,
            TO_PARTS=True,
            BLOCK=BLOCK,
            num_warps=8,
        )
    return parts


def best_of_parts(
    parts: torch.Tensor, temperatures: torch.Tensor, vocab_size: int, out: torch.Tensor
) -> torch.Tensor:
    """``gumbel_parts`` of each share [groups, 2, rows, chunks], in id order, into ``out``."""
    groups, _, rows, num_chunks = parts.shape
    assert parts.is_contiguous() and parts.dtype == torch.int32
    if rows:
        _best_of_parts_kernel[(rows,)](
            temperatures,
            out,
            parts[:, 0].view(torch.float32),
            parts[:, 1],
            2 * rows * num_chunks,
            vocab_size,
            NUM_PARTS=num_chunks,
            GROUPS=groups,
            PARTS_PAD=triton.next_power_of_2(groups * num_chunks),
            num_warps=1,
        )
    return out


def sharded_gumbel_argmax(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """``gumbel_argmax`` over the ranks' vocabulary shares: every rank gets the same tokens."""
    parts = gumbel_parts(logits, temperatures, seeds, vocab_start)
    gathered = parts.new_empty(dist.get_world_size(), *parts.shape)
    dist.all_gather_into_tensor(gathered, parts)
    return best_of_parts(gathered, temperatures, vocab_size, out)


def _check(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, chunk: int
) -> None:
    assert (
        logits.stride(1) == 1 and temperatures.dtype == torch.float32 and seeds.dtype == torch.int64
    )
    assert chunk % BLOCK == 0
