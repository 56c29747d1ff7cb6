"""The plain temperature draw fused into one pass over the logits (GPU): per row,
argmax(logits / T + gumbel) with the same counter-based noise as ``torch_ops.gumbel_argmax``,
or the plain argmax when T = 0. No softmax, no noise tensor, no float32 copy of the logits.

A row's vocabulary is split into chunks of ``CHUNK`` entries, one program each, so that even a
few rows keep every SM reading (one program per row would walk 151,936 logits alone, one load after
the other); a second small kernel picks each row's best of its chunks' winners.
"""
import torch
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
def _gumbel_argmax_kernel(logits_ptr, stride, temperatures_ptr, seeds_ptr, out_ptr, part_val_ptr, part_id_ptr,
                          vocab, chunk, NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """One program: one chunk of one row. With one chunk per row it writes the token id; otherwise
    the chunk's best score and id, for ``_best_of_chunks_kernel``. grid: (rows, NUM_CHUNKS)"""
    row = tl.program_id(0)
    part = tl.program_id(1)
    t = tl.load(temperatures_ptr + row)
    if t < 0:  # a row this launch does not sample (a CUDA graph's padding, or sampled elsewhere)
        return
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    lo = part * chunk
    hi = tl.minimum(lo + chunk, vocab)
    for start in range(lo, hi, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        mask = ids < hi
        x = tl.load(logits_ptr + row.to(tl.int64) * stride + ids, mask=mask, other=float("-inf")).to(tl.float32)
        if t > 0:
            bits = _mix32(_mix32(ids.to(tl.uint32)) ^ seed)
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            x = x / t - tl.log(-tl.log(u))
            x = tl.where(mask, x, float("-inf"))
        better = x > best  # strict: each lane keeps its first maximum
        best = tl.where(better, x, best)
        best_id = tl.where(better, ids, best_id)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_id, vocab), axis=0)  # the lowest id among equal maxima
    if NUM_CHUNKS == 1:
        tl.store(out_ptr + row, first.to(tl.int64))
    else:
        tl.store(part_val_ptr + row * NUM_CHUNKS + part, top)
        tl.store(part_id_ptr + row * NUM_CHUNKS + part, first)


@triton.jit
def _best_of_chunks_kernel(temperatures_ptr, out_ptr, part_val_ptr, part_id_ptr, vocab,
                           NUM_CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Each row's token: the best of its chunks' winners, the lowest id among equal scores (chunks
    cover increasing ids, so this is the lowest id of the whole row). grid: (rows,)"""
    row = tl.program_id(0)
    if tl.load(temperatures_ptr + row) < 0:
        return
    parts = tl.arange(0, CHUNKS_PAD)
    mask = parts < NUM_CHUNKS
    val = tl.load(part_val_ptr + row * NUM_CHUNKS + parts, mask=mask, other=float("-inf"))
    ids = tl.load(part_id_ptr + row * NUM_CHUNKS + parts, mask=mask, other=vocab)
    top = tl.max(val, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(val == top, ids, vocab), axis=0).to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  out: torch.Tensor | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """logits [rows, vocab] (last dim contiguous, any float dtype), temperatures [rows] float32 (0 =
    greedy; below 0: the row is skipped, its ``out`` entry left as it was), seeds [rows] int64 in
    [0, 2**32). ``chunk``: logits per program, a multiple of BLOCK. Returns ``out`` (or a new [rows]
    int64 tensor) holding the token ids."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and temperatures.dtype == torch.float32 and seeds.dtype == torch.int64
    assert chunk % BLOCK == 0
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    num_chunks = triton.cdiv(vocab, chunk)
    part_val = part_id = out  # unused with one chunk
    if num_chunks > 1:
        part_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
        part_id = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(rows, num_chunks)](
        logits, logits.stride(0), temperatures, seeds, out, part_val, part_id, vocab, chunk,
        NUM_CHUNKS=num_chunks, BLOCK=BLOCK, num_warps=8,
    )
    if num_chunks > 1:
        _best_of_chunks_kernel[(rows,)](
            temperatures, out, part_val, part_id, vocab,
            NUM_CHUNKS=num_chunks, CHUNKS_PAD=triton.next_power_of_2(num_chunks), num_warps=1,
        )
    return out
