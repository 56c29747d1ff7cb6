"""The sampling math beyond the plain draw, in torch (docs/sampling.md)."""

import torch

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**31: the int64 products below never overflow


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # a 32-bit xor-shift-multiply hash, on int64 tensors holding values in [0, 2**32)
    x = ((x ^ (x >> 16)) * _MIX) & _MASK32
    x = ((x ^ (x >> 16)) * _MIX) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """24-bit uniforms in (0, 1) per (seed [rows], token id [vocab] or [rows, k])."""
    ids = token_ids if token_ids.dim() == 2 else token_ids.unsqueeze(0)
    x = _mix32(_mix32(ids.long()) ^ seeds.unsqueeze(1))
    return ((x >> 8).float() + 0.5) * 2.0**-24


def gumbel(seeds: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise(seeds, token_ids)))


def gumbel_argmax(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """argmax(logits / T + gumbel) per row (T = 0: argmax): ``triton_draw``'s reference."""
    logits = logits.float()
    greedy = (temperatures == 0).unsqueeze(1)
    noise = gumbel(seeds, torch.arange(logits.size(1), device=logits.device))
    scores = logits / torch.where(greedy, 1.0, temperatures.unsqueeze(1)) + noise
    return torch.where(greedy, logits, scores).argmax(dim=-1)


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    prompt_tokens: tuple[torch.Tensor, torch.Tensor],
    output_tokens: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """In place on ``rows``; tokens are (index into rows, id) pairs, one per occurrence."""
    shape = (rows.numel(), logits.size(1))
    counts = torch.zeros(shape, device=logits.device).index_put_(
        output_tokens, torch.ones(output_tokens[0].numel(), device=logits.device), accumulate=True
    )
    in_prompt = torch.zeros(shape, dtype=torch.bool, device=logits.device)
    in_prompt[prompt_tokens] = True
    x = logits[rows]
    r = repetition.unsqueeze(1)
    x = torch.where(in_prompt | (counts > 0), torch.where(x > 0, x / r, x * r), x)
    x -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0)
    logits[rows] = x


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf where bit ``t % 32`` of word ``t // 32`` is clear (xgrammar's layout)."""
    vocab = logits.size(1)
    # the words' bytes, least significant first (little-endian), then each byte's bits: [G, 32 * W]
    as_bytes = bitmask.contiguous().view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    allowed = ((as_bytes.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    if allowed.size(1) < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.size(1)))
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))


def _candidates(logits, temperatures, top_k, top_p, min_p, num_candidates, all_top_k):
    # the most likely tokens (scaled by 1 / T), which of them the filters keep, and whether
    # that kept set may reach past them (complete False)
    vocab = logits.size(1)
    vals, ids = logits.topk(num_candidates, dim=-1)  # sorted, most likely first
    t = temperatures.unsqueeze(1)
    vals = vals.float() / t
    keep = torch.isfinite(vals)
    min_threshold = None
    if min_p is not None:  # prob < min_p * max prob  <=>  logit / T < max logit / T + log(min_p)
        min_threshold = vals[:, :1] + torch.log(min_p).unsqueeze(1)
        keep &= vals >= min_threshold
    has_top_k = top_k > 0
    rank = torch.arange(num_candidates, device=logits.device)
    keep &= rank < torch.where(has_top_k, top_k, vocab).unsqueeze(1)
    # top-p normalises over what top-k and min-p left: the kept candidates, or the whole row
    masked = vals.masked_fill(~keep, float("-inf"))
    norm = torch.logsumexp(masked, dim=-1)
    if num_candidates < vocab and not all_top_k:
        full = logits.float() / t
        if min_threshold is not None:
            full = full.masked_fill(full < min_threshold, float("-inf"))
        norm = torch.where(has_top_k, norm, torch.logsumexp(full, dim=-1))
    probs = torch.exp(masked - norm.unsqueeze(1))
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= (mass_before < top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1.0)
    complete = has_top_k | ~keep[:, -1] | (num_candidates == vocab)
    return vals, ids, keep, complete


def sample_filtered(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None,
    num_candidates: int,
    all_top_k: bool,
) -> torch.Tensor:
    """A token per row among those min-p, top-k and top-p keep (top_k 0, top_p 1: off)."""
    vocab = logits.size(1)
    num_candidates = min(num_candidates, vocab)
    vals, ids, keep, complete = _candidates(
        logits, temperatures, top_k, top_p, min_p, num_candidates, all_top_k
    )
    scores = (vals + gumbel(seeds, ids)).masked_fill(~keep, float("-inf"))
    tokens = ids.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
    if num_candidates < vocab and not all_top_k and not bool(complete.all()):
        redo = (~complete).nonzero().squeeze(1)
        args = [logits[redo], temperatures[redo], seeds[redo], top_k[redo], top_p[redo]]
        args.append(None if min_p is None else min_p[redo])
        drawn = vocab if logits.is_cuda else _cpu_draw(*args[:3], *args[4:])
        if isinstance(drawn, int):  # how many candidates hold every kept token, and one more
            drawn = sample_filtered(*args, vocab if drawn <= num_candidates else drawn, False)
        tokens[redo] = drawn
    return tokens


def _cpu_draw(logits, temperatures, seeds, top_p, min_p, buckets: int = 2048):
    # (CPU) for rows without top-k: how many candidates suffice, where they are few; else the
    # draw over the whole vocabulary, sorting only the tokens in the value buckets near the cut
    x = logits.float() / temperatures.unsqueeze(1)
    top = x.max(dim=1, keepdim=True).values
    if not bool(top.isfinite().all()):
        return x.size(1)
    keep = torch.isfinite(x)
    if min_p is not None:
        keep &= x >= top + torch.log(min_p).unsqueeze(1)
    p = torch.exp(x - top).masked_fill_(~keep, 0).double()
    p /= p.sum(dim=1, keepdim=True)
    low = x.masked_fill(~keep, float("inf")).min(dim=1, keepdim=True).values
    scale = buckets / (top - low).clamp_(min=1e-30)
    bucket = ((top - x) * scale).clamp_(0, buckets - 1).long()
    mass = p.new_zeros(p.size(0), buckets).scatter_add_(1, bucket, p).cumsum_(dim=1)
    top_p = top_p.double().unsqueeze(1)
    cut = top_p < 1
    sure = (mass < top_p - 1e-4).sum(dim=1, keepdim=True)  # buckets below: kept, whatever rounds
    keep &= (bucket <= (mass < top_p + 1e-4).sum(dim=1, keepdim=True)) | ~cut
    if (needed := int(keep.sum(dim=1).max()) + 1) * 4 <= x.size(1):
        return needed
    unsure = keep & (bucket >= sure) & cut
    if n := int(unsure.sum(dim=1).max()):
        vals, ids = x.masked_fill(~unsure, float("-inf")).topk(n, dim=1)
        q = p.gather(1, ids).masked_fill_(vals == float("-inf"), 0)
        before = torch.where(sure > 0, mass.gather(1, (sure - 1).clamp(min=0)), 0.0)
        drop = (before + q.cumsum(dim=1) - q >= top_p) & (vals > float("-inf"))
        keep.scatter_(1, ids, keep.gather(1, ids) & ~drop)
    scores = x + gumbel(seeds, torch.arange(x.size(1)))
    return scores.masked_fill_(~keep, float("-inf")).argmax(dim=1)


def top_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``tokens``' log_softmax [rows], the ``num`` largest [rows, num] with their ids, and
    the ``tokens``' ranks [rows]: how many tokens are at least as likely (itself included)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_vals, top_ids = logprobs.topk(num, dim=-1)
    ranks = (logprobs >= sampled.unsqueeze(1)).sum(dim=1)
    return sampled, top_vals, top_ids, ranks
