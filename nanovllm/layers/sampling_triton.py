"""The plain temperature draw fused into one pass over the logits (GPU): per row,
argmax(logits / T + gumbel) with the same counter-based noise as ``sampling_torch.gumbel_argmax``,
or the plain argmax when T = 0. No softmax, no noise tensor, no float32 copy of the logits."""
import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _mix32(x):
    # the hash of sampling_torch._mix32 on uint32 lanes (products wrap modulo 2**32)
    x = (x ^ (x >> 16)) * 0x45D9F3B
    x = (x ^ (x >> 16)) * 0x45D9F3B
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, temperatures_ptr, seeds_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temperatures_ptr + row)
    if t < 0:  # a row this launch does not sample (a CUDA graph's padding, or sampled elsewhere)
        return
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        mask = ids < vocab
        x = tl.load(logits_ptr + row * stride + ids, mask=mask, other=float("-inf")).to(tl.float32)
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
    tl.store(out_ptr + row, first.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, vocab] (last dim contiguous, any float dtype), temperatures [rows] float32 (0 =
    greedy; below 0: the row is skipped, its ``out`` entry left as it was), seeds [rows] int64 in
    [0, 2**32). Returns ``out`` (or a new [rows] int64 tensor) holding the token ids."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and temperatures.dtype == torch.float32 and seeds.dtype == torch.int64
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](logits, logits.stride(0), temperatures, seeds, out, vocab, BLOCK=BLOCK, num_warps=8)
    return out
