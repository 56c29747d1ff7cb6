"""A step's model inputs (token ids, positions, the attention context), built on the host."""

from collections.abc import Callable

import numpy as np
import torch

from nanovllm.engine.step import Step
from nanovllm.utils.context import Context

ToDevice = Callable[[list | np.ndarray, torch.dtype], torch.Tensor]  # host data to the device
TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}


def write_block_tables(out: np.ndarray, tables: list[list[int]]) -> np.ndarray:
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    ids = np.fromiter((b for t in tables for b in t), np.int32, int(lens.sum()))
    out[: len(tables)][np.arange(out.shape[1]) < lens[:, None]] = ids
    return out


def block_table_array(tables: list[list[int]]) -> np.ndarray:
    out = np.full((len(tables), max(map(len, tables))), -1, dtype=np.int32)
    return write_block_tables(out, tables)


def slot_mapping(tables: np.ndarray, rows, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot of token ``j`` (row ``rows[j]``, at ``positions[j]``); -1: not stored."""
    if not tables.shape[1]:  # no cache yet (the warm-up)
        return np.full(len(positions), -1, dtype=np.int64)
    blocks = tables[rows, positions // block_size].astype(np.int64)
    return np.where(blocks >= 0, blocks * block_size + positions % block_size, -1)


def prefill_inputs(step: Step, block_size: int, to_device: ToDevice) -> tuple:
    n = step.num_seqs
    starts = np.array(step.num_computed, dtype=np.int64)
    lens = np.array(step.num_new, dtype=np.int64)
    ends = starts + lens
    cu_q = np.concatenate(([0], np.cumsum(lens)))
    cu_k = np.concatenate(([0], np.cumsum(ends)))
    num_tokens = int(cu_q[-1])
    row = np.repeat(np.arange(n), lens)  # each token's sequence
    positions = np.arange(num_tokens) - np.repeat(cu_q[:-1] - starts, lens)
    tables = block_table_array(step.block_tables)
    context = Context(
        is_prefill=True,
        cu_seqlens_q=to_device(cu_q, torch.int32),
        cu_seqlens_k=to_device(cu_k, torch.int32),
        max_seqlen_q=int(lens.max()),
        max_seqlen_k=int(ends.max()),
        slot_mapping=to_device(slot_mapping(tables, row, positions, block_size), torch.int32),
        block_tables=to_device(tables, torch.int32) if cu_k[-1] > cu_q[-1] else None,
    )
    input_ids = np.array(step.token_ids, dtype=np.int64)
    return to_device(input_ids, torch.int64), to_device(positions, torch.int64), context


# A decode step's inputs, one row per sequence: (name, element type, a padding row's value), then
# the block tables [rows, max_blocks] int32. prev_rows: the previous step's row holding the input.
DECODE_FIELDS = (
    ("input_ids", np.int64, 0),
    ("prev_rows", np.int64, -1),
    ("positions", np.int64, 0),
    ("seeds", np.int64, 0),
    ("slot_mapping", np.int32, -1),
    ("context_lens", np.int32, 0),
    ("temperatures", np.float32, 0.0),
)


class DecodeLayout:
    """Byte offsets of ``DECODE_FIELDS`` and the block tables for ``max_rows`` rows."""

    def __init__(self, max_rows: int, max_blocks: int):
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.offsets, offset = {}, 0
        for name, dtype, _ in DECODE_FIELDS:
            self.offsets[name] = offset
            offset += max_rows * np.dtype(dtype).itemsize
        self.offsets["block_tables"] = offset
        self.nbytes = offset + max_rows * max_blocks * 4

    def used_bytes(self, rows: int) -> int:
        return self.offsets["block_tables"] + rows * self.max_blocks * 4

    def fields(self, buffer, view) -> dict:
        out = {}
        for name, dtype, _ in DECODE_FIELDS:
            start = self.offsets[name]
            end = start + self.max_rows * np.dtype(dtype).itemsize
            out[name] = view(buffer[start:end], dtype)
        tables = view(buffer[self.offsets["block_tables"] : self.nbytes], np.int32)
        out["block_tables"] = tables.reshape(self.max_rows, self.max_blocks)
        return out


def fill_decode(fields: dict[str, np.ndarray], step: Step, rows: int, block_size: int) -> None:
    """Write a decode step into ``fields`` (NumPy); rows past ``step.num_seqs`` are padding."""
    n = step.num_seqs
    positions = fields["positions"]
    positions[:n] = step.num_computed
    fields["input_ids"][:n] = step.token_ids
    fields["context_lens"][:n] = positions[:n] + 1
    fields["prev_rows"][:n] = -1 if step.prev_rows is None else step.prev_rows
    sampling = step.sampling
    fields["temperatures"][:n] = 0.0 if sampling is None else sampling.temperatures
    fields["seeds"][:n] = 0 if sampling is None else sampling.seeds
    tables = fields["block_tables"][:rows]
    tables.fill(0)
    write_block_tables(tables, step.block_tables)
    fields["slot_mapping"][:n] = slot_mapping(tables, np.arange(n), positions[:n], block_size)
    for name, _, pad in DECODE_FIELDS:
        fields[name][n:rows] = pad


def decode_inputs(v: dict[str, torch.Tensor], sampled: torch.Tensor, rows: int) -> tuple:
    """The first ``rows`` rows; an input token from ``sampled`` where ``prev_rows`` names one."""
    prev = v["prev_rows"][:rows]
    input_ids = torch.where(prev >= 0, sampled[prev.clamp(min=0)], v["input_ids"][:rows])
    context = Context(
        is_prefill=False,
        slot_mapping=v["slot_mapping"][:rows],
        context_lens=v["context_lens"][:rows],
        block_tables=v["block_tables"][:rows],
    )
    return input_ids, v["positions"][:rows], context


class DecodeBuffer:
    """Decode inputs in one buffer of fixed layout, filled in a host copy, in turn one of two on a
    GPU; the CUDA graphs read the device buffer in place. A graph of turn ``k`` copies host copy
    ``k`` in itself (``stage``); any other step has it sent with one copy. A host copy is refilled
    once the work queued after its last fill (``done``) has passed."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device):
        self.layout = DecodeLayout(max_rows, max_blocks)
        self.buffer = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        self.fields = self.layout.fields(self.buffer, lambda p, dtype: p.view(TORCH_DTYPES[dtype]))
        self.staging = [self.buffer]  # the CPU: the buffer itself; a GPU: two pinned, in turn
        if device.type != "cpu":
            size, u8 = self.layout.nbytes, torch.uint8
            self.staging = [torch.zeros(size, dtype=u8, pin_memory=True) for _ in range(2)]
        self.staged = [self.layout.fields(s.numpy(), lambda p, t: p.view(t)) for s in self.staging]
        for name, _, pad in DECODE_FIELDS:  # all padding: a graph captured over it writes no slot
            self.fields[name].fill_(pad)
            for staged in self.staged:
                staged[name][:] = pad
        self.copied: list[torch.cuda.Event | None] = [None] * len(self.staging)
        self.turn = 0

    def send(self, step: Step, rows: int, block_size: int, staged: bool = False) -> int:
        """Fill the next host copy with ``step`` (``rows``, padded) and queue its copy, unless a
        graph will ``stage`` it; returns its turn."""
        k = self.turn = (self.turn + 1) % len(self.staging)
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        fill_decode(self.staged[k], step, rows, block_size)
        if self.staging[k] is not self.buffer and not staged:
            used = self.layout.used_bytes(rows)
            self.buffer[:used].copy_(self.staging[k][:used], non_blocking=True)
            self.done()
        return k

    def stage(self, turn: int, rows: int) -> None:
        """Queue host copy ``turn``'s first ``rows`` rows into the buffer, read by a kernel."""
        from nanovllm.runner.host_copy import copy_words

        copy_words(self.staging[turn], self.buffer, self.layout.used_bytes(rows))

    def done(self) -> None:
        """The current host copy is read by the work queued so far."""
        if self.staging[self.turn] is not self.buffer:
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()
