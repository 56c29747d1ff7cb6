"""Per-step model inputs: token ids, positions and the attention context of a prefill or decode
step, built on the host from the scheduled sequences (every rank builds its own)."""
from collections.abc import Callable
from itertools import chain

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.utils.context import Context

ToDevice = Callable[[list | np.ndarray, torch.dtype], torch.Tensor]  # host data to a tensor on the rank's device


def _block_table_array(seqs: list[Sequence]) -> np.ndarray:
    """The sequences' block tables as one [num_seqs, width] int32 array, padded with -1."""
    tables = np.full((len(seqs), max(len(seq.block_table) for seq in seqs)), -1, dtype=np.int32)
    for row, seq in zip(tables, seqs):
        row[: len(seq.block_table)] = seq.block_table
    return tables


def prepare_prefill(
    seqs: list[Sequence], block_size: int, to_device: ToDevice
) -> tuple[torch.Tensor, torch.Tensor, Context]:
    """The ``num_scheduled_tokens`` tokens after each sequence's cached prefix. Built with NumPy:
    a step may hold ``max_num_batched_tokens`` tokens, and Python lists of them would cost
    milliseconds per step."""
    n = len(seqs)
    starts = np.fromiter((seq.num_cached_tokens for seq in seqs), np.int64, n)
    lens = np.fromiter((seq.num_scheduled_tokens for seq in seqs), np.int64, n)
    ends = starts + lens
    cu_q = np.concatenate(([0], np.cumsum(lens)))
    cu_k = np.concatenate(([0], np.cumsum(ends)))
    num_tokens = int(cu_q[-1])
    input_ids = np.fromiter(chain.from_iterable(seq.scheduled_token_ids() for seq in seqs), np.int64, num_tokens)
    row = np.repeat(np.arange(n), lens)  # each token's sequence
    positions = np.arange(num_tokens) - np.repeat(cu_q[:-1] - starts, lens)
    tables = _block_table_array(seqs)
    if tables.shape[1]:
        blocks = tables[row, positions // block_size].astype(np.int64)
        slot_mapping = np.where(blocks >= 0, blocks * block_size + positions % block_size, -1)
    else:  # no cache yet (the warm-up): nothing is stored
        slot_mapping = np.full(num_tokens, -1)
    has_prefix = cu_k[-1] > cu_q[-1]
    context = Context(
        is_prefill=True,
        cu_seqlens_q=to_device(cu_q, torch.int32),
        cu_seqlens_k=to_device(cu_k, torch.int32),
        max_seqlen_q=int(lens.max()),
        max_seqlen_k=int(ends.max()),
        slot_mapping=to_device(slot_mapping, torch.int32),
        block_tables=to_device(tables, torch.int32) if has_prefix else None,
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
        block_tables=to_device(_block_table_array(seqs), torch.int32),
    )
    input_ids = to_device([seq.last_token for seq in seqs], torch.int64)
    return input_ids, to_device(positions, torch.int64), context


# ---- decode inputs staged for a CUDA graph ---------------------------------------------------------

# A decode graph's inputs, one row per sequence, as fields of one buffer: (name, element type, fill
# value of a padding row). Block tables, [rows, max_blocks] int32, come last. The host fills a pinned
# copy of the buffer and sends it with one copy; the graph reads the device copy's fields in place.
DECODE_FIELDS = (
    ("input_ids", np.int64, 0),
    ("prev_rows", np.int64, -1),  # the row of the previous step's sampled ids that holds the input token, or -1
    ("positions", np.int64, 0),
    ("seeds", np.int64, 0),  # the draw's noise seed (see sampling_batch.draw_seed)
    ("slot_mapping", np.int32, -1),
    ("context_lens", np.int32, 0),
    ("temperatures", np.float32, -1.0),  # < 0: the graph does not sample this row
)


class DecodeLayout:
    """Byte offsets of ``DECODE_FIELDS`` and the block tables for up to ``max_rows`` rows."""

    def __init__(self, max_rows: int, max_blocks: int):
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.offsets, offset = {}, 0
        for name, dtype, _ in DECODE_FIELDS:
            self.offsets[name] = offset
            offset += max_rows * np.dtype(dtype).itemsize
        self.offsets["block_tables"] = offset
        self.nbytes = offset + max_rows * max_blocks * 4

    def used_bytes(self, rows: int) -> int:
        """The prefix of the buffer that a step of ``rows`` rows (padded) fills."""
        return self.offsets["block_tables"] + rows * self.max_blocks * 4

    def fields(self, buffer, view) -> dict:
        """Each field over ``buffer`` (uint8; a NumPy array or a torch tensor): ``view(part, dtype)``
        reinterprets a byte slice as that field's type."""
        out = {}
        for name, dtype, _ in DECODE_FIELDS:
            start = self.offsets[name]
            out[name] = view(buffer[start : start + self.max_rows * np.dtype(dtype).itemsize], dtype)
        start = self.offsets["block_tables"]
        out["block_tables"] = view(buffer[start : self.nbytes], np.int32).reshape(self.max_rows, self.max_blocks)
        return out


def fill_decode(fields: dict[str, np.ndarray], seqs: list[Sequence], rows: int, block_size: int,
                prev_rows: list[int] | None, sampling: tuple[list[float], list[int]] | None) -> None:
    """Write a decode step of ``seqs`` into ``fields`` (NumPy arrays of ``DecodeLayout.fields``):
    the values of ``prepare_decode``, the previous-step rows of pending tokens, and ``sampling``'s
    (temperatures, seeds) when the graph samples; rows ``len(seqs)`` to ``rows`` are padding."""
    n = len(seqs)
    lens = [seq.num_tokens for seq in seqs]
    fields["input_ids"][:n] = [seq.last_token for seq in seqs]
    fields["context_lens"][:n] = lens
    fields["positions"][:n] = lens
    fields["positions"][:n] -= 1
    fields["slot_mapping"][:n] = [seq.block_table[(k - 1) // block_size] * block_size + (k - 1) % block_size
                                  for seq, k in zip(seqs, lens)]
    fields["prev_rows"][:n] = -1 if prev_rows is None else prev_rows
    if sampling is None:
        fields["temperatures"][:n] = -1.0
        fields["seeds"][:n] = 0
    else:
        fields["temperatures"][:n], fields["seeds"][:n] = sampling
    for name, _, pad in DECODE_FIELDS:
        fields[name][n:rows] = pad
    tables = [seq.block_table for seq in seqs]
    widths = np.fromiter(map(len, tables), np.int64, n)
    block_tables = fields["block_tables"][:rows]
    block_tables.fill(0)
    block_tables[:n][np.arange(block_tables.shape[1]) < widths[:, None]] = np.fromiter(
        chain.from_iterable(tables), np.int32, int(widths.sum())
    )
