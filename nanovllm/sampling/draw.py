"""The plain temperature draw: Gumbel-max on a GPU (``triton_draw``), inverse CDF on the CPU."""

import torch

_MASK64 = (1 << 64) - 1
CDF_BITS = 60  # a probability p counts as the integer floor(p * 2**60): int64 sums are exact
CDF_BLOCK = 128  # tokens per block of the two-level search
CDF_GROUP = 1 << 19  # logits per pass (rows at a time): 2 MB of float32 stay in cache


def row_uniform_bits(draw_seed: int) -> int:
    # the row's 64-bit uniform: splitmix64 of its draw seed
    x = (draw_seed + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def cdf_draw(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row, ``v`` with probability ``floor(p_v * 2**60) / S`` (p = softmax(logits /
    T)); T = 0: the argmax."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    temps = temperatures.tolist()
    drawn = [i for i, t in enumerate(temps) if t > 0]
    greedy = [i for i, t in enumerate(temps) if t <= 0]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    if not drawn:
        return tokens
    every_row = len(drawn) == rows
    x = logits if every_row else logits[drawn]
    inv_t = (1.0 / (temperatures if every_row else temperatures[drawn]).float()).unsqueeze(1)
    uniforms = [row_uniform_bits(s) for s in (seeds if every_row else seeds[drawn]).tolist()]
    out = torch.empty(len(drawn), dtype=torch.int64, device=logits.device)
    group = max(1, CDF_GROUP // vocab)
    for start in range(0, len(drawn), group):
        end = min(start + group, len(drawn))
        out[start:end] = _cdf_search(x[start:end], inv_t[start:end], uniforms[start:end])
    if every_row:
        return out
    tokens[drawn] = out
    return tokens


def _cdf_search(x: torch.Tensor, inv_t: torch.Tensor, uniforms: list[int]) -> torch.Tensor:
    # cdf_draw on a few rows: x [g, vocab] logits, inv_t [g, 1] float32 (1 / T)
    g, vocab = x.shape
    scaled = x.float() * inv_t
    q = torch.softmax(scaled, dim=1).mul_(2.0**CDF_BITS)  # whole once truncated
    full = vocab - vocab % CDF_BLOCK
    blocks = q[:, :full].view(g, full // CDF_BLOCK, CDF_BLOCK).sum(dim=2, dtype=torch.int64)
    if full < vocab:  # a last, shorter block
        blocks = torch.cat([blocks, q[:, full:].sum(dim=1, dtype=torch.int64, keepdim=True)], dim=1)
    cum = blocks.cumsum_(dim=1)  # [g, blocks] int64
    totals = cum[:, -1].tolist()
    targets = torch.tensor([(u * s) >> 64 for u, s in zip(uniforms, totals)], dtype=torch.int64)
    targets = targets.unsqueeze(1)  # [g, 1]: uniform on [0, S)
    block = torch.searchsorted(cum, targets, right=True)  # the first block whose sum passes it
    before = torch.where(block > 0, cum.gather(1, (block - 1).clamp_(min=0)), 0)
    cols = block * CDF_BLOCK + torch.arange(CDF_BLOCK)  # [g, CDF_BLOCK]: the block's tokens
    inside = q.gather(1, cols.clamp(max=vocab - 1)).to(torch.int64)
    inside = inside.masked_fill_(cols >= vocab, 0).cumsum_(dim=1)
    offset = torch.searchsorted(inside, targets - before, right=True)
    tokens = (block * CDF_BLOCK + offset).squeeze(1)
    if bad := q[:, 0].isnan().nonzero().squeeze(1).tolist():  # a NaN or inf: all of q is NaN
        tokens[bad] = _non_finite(scaled[bad], [uniforms[i] for i in bad])
    return tokens


def _non_finite(scaled: torch.Tensor, uniforms: list[int]) -> torch.Tensor:
    # NaN counts as -inf; the lowest +inf id wins, token 0 where all are -inf; else draw again
    scaled = scaled.masked_fill(scaled.isnan(), float("-inf"))
    top, tokens = scaled.max(dim=1)
    if rows := top.isfinite().nonzero().squeeze(1).tolist():
        ones = torch.ones(len(rows), 1)
        tokens[rows] = _cdf_search(scaled[rows], ones, [uniforms[i] for i in rows])
    return tokens


def plain_draw(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor):
    if logits.is_cuda:
        from nanovllm.sampling.triton_draw import gumbel_argmax

        return gumbel_argmax(logits, temperatures, seeds)
    return cdf_draw(logits, temperatures, seeds)
