"""A step's inputs, from the step description the core builds (``build_step``). Prefill
(``prefill_inputs``): exact values for hand-built sequences with cached prefixes and chunks, and
against a token-by-token reference. Decode, eager or as a CUDA graph receives it (``DecodeLayout``,
``fill_decode``, ``DecodeBuffer``, ``decode_inputs``): exact values for hand-built sequences,
against a token-by-token reference, padding rows that write no cache slot, and placeholder tokens
read from the previous step's sampled ids."""

from random import Random

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step import build_step
from nanovllm.runner.step_inputs import (
    DECODE_FIELDS,
    DecodeBuffer,
    DecodeLayout,
    decode_inputs,
    fill_decode,
    prefill_inputs,
)
from nanovllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def decode_seq(num_tokens: int, block_table: list[int], pending_row: int | None = None) -> Sequence:
    """A running sequence of ``num_tokens`` tokens (the last a placeholder of ``pending_row``)."""
    seq = Sequence(
        list(range(100, 100 + num_tokens - (pending_row is not None))), SamplingParams(), BLOCK_SIZE
    )
    if pending_row is not None:
        seq.append_placeholder(pending_row)
    seq.block_table = list(block_table)
    seq.num_cached_tokens = num_tokens - 1
    return seq


def to_tensor(data, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype)


def prefill_seq(num_tokens: int, block_table: list[int], cached: int, scheduled: int) -> Sequence:
    """A prompt of ``num_tokens`` tokens (ids 1000 + position) whose first ``cached`` are in the
    cache and whose next ``scheduled`` this step computes."""
    seq = Sequence([1000 + i for i in range(num_tokens)], SamplingParams(), BLOCK_SIZE)
    seq.block_table = list(block_table)
    seq.num_cached_tokens = cached
    seq.num_scheduled_tokens = scheduled
    return seq


def prepare_prefill(seqs, block_size, to_device):
    return prefill_inputs(build_step(seqs, True, Random(0)), block_size, to_device)


def decode_step(seqs):
    return build_step(seqs, False, Random(0))


def test_prepare_prefill_exact_values():
    seqs = [
        prefill_seq(6, [9, 2], cached=0, scheduled=6),  # positions 0-5: blocks 9 and 2
        prefill_seq(
            10, [4, 7, 1], cached=4, scheduled=5
        ),  # a cached block, then a chunk of 5 (positions 4-8)
        prefill_seq(3, [5], cached=2, scheduled=1),  # the last token after a cached prefix
    ]
    input_ids, positions, context = prepare_prefill(seqs, BLOCK_SIZE, to_tensor)
    assert input_ids.tolist() == [
        1000,
        1001,
        1002,
        1003,
        1004,
        1005,
        1004,
        1005,
        1006,
        1007,
        1008,
        1002,
    ]
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 2]
    assert context.slot_mapping.tolist() == [36, 37, 38, 39, 8, 9, 28, 29, 30, 31, 4, 22]
    assert context.cu_seqlens_q.tolist() == [0, 6, 11, 12] and context.cu_seqlens_k.tolist() == [
        0,
        6,
        15,
        18,
    ]
    assert (context.max_seqlen_q, context.max_seqlen_k) == (6, 9)
    assert context.block_tables.tolist() == [
        [9, 2, -1],
        [4, 7, 1],
        [5, -1, -1],
    ]  # a cached prefix: tables sent
    assert (
        input_ids.dtype == positions.dtype == torch.int64
        and context.slot_mapping.dtype == torch.int32
    )
    assert context.is_prefill


def test_prepare_prefill_without_prefix_or_cache():
    """No cached prefix: no block tables; no block tables yet (the warm-up): every slot -1."""
    _, _, context = prepare_prefill(
        [prefill_seq(5, [3, 0], 0, 5), prefill_seq(2, [1], 0, 2)], BLOCK_SIZE, to_tensor
    )
    assert context.block_tables is None and context.slot_mapping.tolist() == [
        12,
        13,
        14,
        15,
        0,
        4,
        5,
    ]
    _, positions, context = prepare_prefill(
        [prefill_seq(3, [], 0, 3), prefill_seq(2, [], 0, 2)], BLOCK_SIZE, to_tensor
    )
    assert positions.tolist() == [0, 1, 2, 0, 1] and context.slot_mapping.tolist() == [-1] * 5


def test_prepare_prefill_matches_token_by_token_reference():
    rng = np.random.default_rng(1)
    seqs = []
    for _ in range(23):
        n = int(rng.integers(1, 60))
        cached = int(rng.integers(0, n // BLOCK_SIZE + 1)) * BLOCK_SIZE if n > BLOCK_SIZE else 0
        cached = min(cached, n - 1)
        scheduled = int(rng.integers(1, n - cached + 1))
        seqs.append(
            prefill_seq(n, rng.permutation(300)[: -(-n // BLOCK_SIZE)].tolist(), cached, scheduled)
        )
    input_ids, positions, context = prepare_prefill(seqs, BLOCK_SIZE, to_tensor)
    want_ids, want_pos, want_slots = [], [], []
    for seq in seqs:
        for p in range(seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens):
            want_ids.append(seq.token_ids[p])
            want_pos.append(p)
            want_slots.append(seq.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
    assert input_ids.tolist() == want_ids and positions.tolist() == want_pos
    assert context.slot_mapping.tolist() == want_slots
    assert context.max_seqlen_q == max(s.num_scheduled_tokens for s in seqs)


def host_fields(layout: DecodeLayout) -> tuple[np.ndarray, dict]:
    buffer = np.full(
        layout.nbytes, 0xAB, dtype=np.uint8
    )  # garbage: every used byte must be written
    return buffer, layout.fields(buffer, lambda part, dtype: part.view(dtype))


def test_layout_fields_are_disjoint_and_aligned():
    layout = DecodeLayout(max_rows=48, max_blocks=5)
    ends = []
    for name, dtype, _ in DECODE_FIELDS:
        start = layout.offsets[name]
        assert start % np.dtype(dtype).itemsize == 0
        ends.append((start, start + 48 * np.dtype(dtype).itemsize))
    ends.append((layout.offsets["block_tables"], layout.nbytes))
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:])) and ends[0][0] == 0
    assert layout.used_bytes(48) == layout.nbytes
    assert layout.used_bytes(16) == layout.offsets["block_tables"] + 16 * 5 * 4


def test_fill_decode_exact_values_and_padding():
    seqs = [
        decode_seq(5, [3, 7]),  # position 4: block 1 (id 7), offset 0
        decode_seq(12, [1, 2, 8], pending_row=2),  # position 11: block 2 (id 8), offset 3
        decode_seq(1, [5]),
    ]
    layout = DecodeLayout(max_rows=8, max_blocks=4)
    _, f = host_fields(layout)
    fill_decode(f, decode_step(seqs), 4, BLOCK_SIZE)
    assert f["input_ids"][:4].tolist() == [104, -1, 100, 0]
    assert f["prev_rows"][:4].tolist() == [-1, 2, -1, -1]
    assert f["positions"][:4].tolist() == [4, 11, 0, 0]
    assert f["context_lens"][:4].tolist() == [5, 12, 1, 0]
    assert f["slot_mapping"][:4].tolist() == [28, 35, 20, -1]
    assert f["block_tables"][:4].tolist() == [
        [3, 7, 0, 0],
        [1, 2, 8, 0],
        [5, 0, 0, 0],
        [0, 0, 0, 0],
    ]
    # rows past the padded batch are not touched
    assert f["input_ids"].view(np.uint8)[4 * 8 :].tolist() == [0xAB] * (4 * 8)


def test_fill_decode_without_placeholders():
    """No token of the previous step in flight: every row -1."""
    seqs = [decode_seq(3, [0]), decode_seq(9, [4, 6, 2])]
    _, f = host_fields(DecodeLayout(max_rows=2, max_blocks=3))
    fill_decode(f, decode_step(seqs), 2, BLOCK_SIZE)
    assert f["prev_rows"].tolist() == [-1, -1]


def test_decode_inputs_match_token_by_token_reference():
    """Random shapes through the CPU buffer (its own host copy): the model's inputs equal each
    sequence's last token, position, slot and table; a placeholder is read from ``sampled``."""
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(37):
        n = int(rng.integers(2, 40))
        blocks = rng.permutation(200)[: -(-n // BLOCK_SIZE)].tolist()
        seqs.append(decode_seq(n, blocks, pending_row=i if i % 3 == 0 else None))
    max_blocks = max(len(s.block_table) for s in seqs)
    buffer = DecodeBuffer(max_rows=48, max_blocks=max_blocks, device=torch.device("cpu"))
    assert buffer.send(decode_step(seqs), 48, BLOCK_SIZE) == 0  # one turn: its own host copy
    fields = buffer.fields
    sampled = torch.arange(500, 548)
    input_ids, positions, context = decode_inputs(fields, sampled, 40)
    want_ids = [500 + s.pending_row if s.num_pending else s.last_token for s in seqs]
    want_pos = [len(s) - 1 for s in seqs]
    want_slots = [
        s.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for s, p in zip(seqs, want_pos)
    ]
    assert input_ids.tolist() == want_ids + [0] * 3  # three padding rows
    assert positions.tolist() == want_pos + [0] * 3
    assert context.slot_mapping.tolist() == want_slots + [-1] * 3
    assert context.context_lens.tolist() == [len(s) for s in seqs] + [0] * 3
    for row, seq in zip(context.block_tables.tolist(), seqs):
        assert row[: len(seq.block_table)] == seq.block_table and set(
            row[len(seq.block_table) :]
        ) <= {0}
    assert not context.is_prefill
