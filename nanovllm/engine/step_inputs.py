"""Per-step model inputs: token ids, positions and the attention context of a prefill or decode
step, built on the host from the scheduled sequences (every rank builds its own)."""
from collections.abc import Callable

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.utils.context import Context

ToDevice = Callable[[list, torch.dtype], torch.Tensor]  # a host list to a tensor on the rank's device


def _block_tables(seqs: list[Sequence], to_device: ToDevice) -> torch.Tensor:
    width = max(len(seq.block_table) for seq in seqs)
    return to_device([seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs], torch.int32)


def prepare_prefill(
    seqs: list[Sequence], block_size: int, to_device: ToDevice
) -> tuple[torch.Tensor, torch.Tensor, Context]:
    """The ``num_scheduled_tokens`` tokens after each sequence's cached prefix."""
    input_ids, positions, slot_mapping = [], [], []
    cu_q, cu_k = [0], [0]
    bs = block_size
    for seq in seqs:
        start = seq.num_cached_tokens
        end = start + seq.num_scheduled_tokens
        input_ids.extend(seq.scheduled_token_ids())
        positions.extend(range(start, end))
        cu_q.append(cu_q[-1] + end - start)
        cu_k.append(cu_k[-1] + end)
        for i in range(start // bs, (end + bs - 1) // bs) if seq.block_table else ():
            offset = seq.block_table[i] * bs - i * bs  # slot of position p in block i: offset + p
            slot_mapping.extend(range(offset + max(start, i * bs), offset + min(end, (i + 1) * bs)))
    has_prefix = cu_k[-1] > cu_q[-1]
    context = Context(
        is_prefill=True,
        cu_seqlens_q=to_device(cu_q, torch.int32),
        cu_seqlens_k=to_device(cu_k, torch.int32),
        max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
        max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])),
        slot_mapping=to_device(slot_mapping, torch.int32),
        block_tables=_block_tables(seqs, to_device) if has_prefix else None,
    )
    return to_device(input_ids, torch.int64), to_device(positions, torch.int64), context


def prepare_decode(
    seqs: list[Sequence], block_size: int, to_device: ToDevice
) -> tuple[torch.Tensor, torch.Tensor, Context]:
    """Each sequence's newest token, whose KV goes to the slot after its cached tokens."""
    bs = block_size
    positions = [len(seq) - 1 for seq in seqs]
    slot_mapping = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)]
    context = Context(
        is_prefill=False,
        slot_mapping=to_device(slot_mapping, torch.int32),
        context_lens=to_device([len(seq) for seq in seqs], torch.int32),
        block_tables=_block_tables(seqs, to_device),
    )
    input_ids = to_device([seq.last_token for seq in seqs], torch.int64)
    return input_ids, to_device(positions, torch.int64), context
