"""Part 1 of ``bench_kv_accuracy.py``: the decode's output over a bf16 and an FP8 paged cache
against float64 attention over the unrounded keys and values (that script's docstring gives the
method)."""

import torch

from nanovllm.layers.attention import get_attention_backend, resolve_backend_name
from nanovllm.layers.attention.fp8_kv import FP8_DTYPE, KV_SCALE_DTYPE
from nanovllm.layers.attention.reference import TorchAttentionBackend
from nanovllm.utils.context import Context

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
BLOCK_SIZE = 256


def paged_tables(
    num_seqs: int, context_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random block ids -> block tables [num_seqs, blocks_per_seq], slots
    [num_seqs * context_len] (int32)"""
    per_seq = -(-context_len // BLOCK_SIZE)
    tables = torch.randperm(num_seqs * per_seq, generator=generator).view(num_seqs, per_seq)
    pos = torch.arange(context_len)
    slots = tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE  # [num_seqs, context_len]
    return tables.to(torch.int32), slots.flatten().to(torch.int32)


def reference_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """float64 attention of one query over all keys. q: [num_heads, head_dim], k/v:
    [n, num_kv_heads, head_dim]."""
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = (
        x.double().repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v)
    )  # [num_heads, n, head_dim]
    probs = torch.softmax(
        (k @ q.double().unsqueeze(-1)).squeeze(-1) * scale, dim=-1
    )  # [num_heads, n]
    return (probs.unsqueeze(1) @ v).squeeze(1)  # [num_heads, head_dim]


def decode_over_cache(
    backend_name: str, kv_cache_dtype: str, q, k, v, tables, slots, context_lens, device
):
    """Store k/v ([num_tokens, num_kv_heads, head_dim] float32) into a fresh paged cache of this
    dtype (the torch store: the Triton one, ``rope_and_store``, writes the same bytes), then decode
    q ([num_seqs, num_heads, head_dim]) over it with the backend."""
    backend, fp8 = get_attention_backend(backend_name), kv_cache_dtype == "fp8"
    shape = (tables.numel(), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [
        torch.zeros(shape, dtype=torch.uint8 if fp8 else torch.bfloat16, device=device)
        for _ in range(2)
    ]
    caches = [c.view(FP8_DTYPE) for c in caches] if fp8 else caches
    scales = [
        torch.zeros(shape[:3], dtype=KV_SCALE_DTYPE, device=device) if fp8 else None
        for _ in range(2)
    ]
    TorchAttentionBackend().store_kvcache(k, v, *caches, slots, *scales)
    context = Context(context_lens=context_lens, block_tables=tables, slot_mapping=slots)
    return backend.decode(q, *caches, context, HEAD_DIM**-0.5, *scales)


def attention_error_table(
    device: str, context_lens: list[int], num_seqs: int, sigma: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    names = {
        kv: resolve_backend_name("auto", device, BLOCK_SIZE, torch.bfloat16, kv)
        for kv in ("auto", "fp8")
    }
    print(
        f"\n### Attention-output error (decode; {NUM_HEADS} q heads, {NUM_KV_HEADS} KV heads, "
        f"head_dim {HEAD_DIM}, block {BLOCK_SIZE}; {num_seqs} sequences per length; "
        f"K channel scales exp(N(0, {sigma})); "
        f"backends: bf16 cache {names['auto']}, fp8 cache {names['fp8']})\n"
    )
    print(
        "| context | rms(ref) | bf16 output floor rel L2 | bf16 cache rel L2 | fp8 cache rel L2 | "
        "bf16 cache max abs | fp8 cache max abs | fp8 / bf16 rel L2 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in context_lens:
        channel_scale = torch.exp(
            torch.randn(num_seqs, 1, NUM_KV_HEADS, HEAD_DIM, generator=g) * sigma
        )
        k = (torch.randn(num_seqs, n, NUM_KV_HEADS, HEAD_DIM, generator=g) * channel_scale).flatten(
            0, 1
        )
        v = torch.randn(num_seqs * n, NUM_KV_HEADS, HEAD_DIM, generator=g)
        q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
        tables, slots = paged_tables(num_seqs, n, g)
        ref = torch.stack(
            [
                reference_decode(
                    q[i], k[i * n : (i + 1) * n], v[i * n : (i + 1) * n], HEAD_DIM**-0.5
                )
                for i in range(num_seqs)
            ]
        )
        lens = torch.full((num_seqs,), n, dtype=torch.int32)
        args = [x.to(device) for x in (q, k, v, tables, slots, lens)]
        out = {
            kv: decode_over_cache(names[kv], kv, *args, device).double().cpu()
            for kv in ("auto", "fp8")
        }
        rel = {kv: ((o - ref).norm() / ref.norm()).item() for kv, o in out.items()}
        floor = ((ref.to(torch.bfloat16).double() - ref).norm() / ref.norm()).item()
        abs_err = {kv: (o - ref).abs().max().item() for kv, o in out.items()}
        print(
            f"| {n} | {ref.pow(2).mean().sqrt().item():.3f} | {floor:.2e} | "
            f"{rel['auto']:.2e} | {rel['fp8']:.2e} | "
            f"{abs_err['auto']:.2e} | {abs_err['fp8']:.2e} | {rel['fp8'] / rel['auto']:.1f}x |"
        )
