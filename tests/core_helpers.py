"""Builders and checks shared by the BlockManager and Scheduler tests (no torch, no model)."""

import struct
from types import SimpleNamespace

import xxhash

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_seq(
    token_ids: list[int],
    *,
    block_size: int = BLOCK_SIZE,
    max_tokens: int = 64,
    ignore_eos: bool = False,
    temperature: float = 0.0,
) -> Sequence:
    """A real Sequence, as the engine would queue it."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Sequence(token_ids, params, block_size)


def make_scheduler(
    *,
    num_blocks: int = 16,
    block_size: int = BLOCK_SIZE,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    eos_token_id: int | list[int] | None = None,
) -> Scheduler:
    limits = SimpleNamespace(kvcache_block_size=block_size, max_num_seqs=max_num_seqs)
    limits.max_num_batched_tokens, limits.max_model_len = max_num_batched_tokens, max_model_len
    eos = [] if eos_token_id is None else eos_token_id
    return Scheduler(limits, num_blocks, [eos] if isinstance(eos, int) else eos)


def expected_hash(token_ids: list[int], prev: int | None = None) -> int:
    """Reference block hash, written independently of BlockManager.compute_hash: xxh64 over the
    previous block's hash (8 bytes little endian, absent for the first block), then the token ids
    as int64 little endian."""
    data = b"" if prev is None else struct.pack("<Q", prev)
    data += struct.pack(f"<{len(token_ids)}q", *token_ids)
    return xxhash.xxh64(data).intdigest()


def expected_chain(token_ids: list[int], block_size: int) -> list[int]:
    """Reference hashes of every full block of ``token_ids``, in order."""
    hashes: list[int] = []
    prev = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = expected_hash(token_ids[start : start + block_size], prev)
        hashes.append(prev)
    return hashes


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Pretend a step computed ``seq``'s next ``num_tokens`` tokens (all of them by default) and
    hash the blocks they fill, as Scheduler.advance does."""
    seq.num_cached_tokens = len(seq) if num_tokens is None else seq.num_cached_tokens + num_tokens
    bm.hash_blocks(seq)


def free_queue(bm: BlockManager) -> list[int]:
    """The free block ids, front (next handed out) first."""
    return list(bm.free_block_ids)


def check_block_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    """Reference counts, pool partition, hash map and per-block content of the live sequences."""
    num_blocks = len(bm.blocks)
    free = list(bm.free_block_ids)
    used = set(bm.used_block_ids)
    assert len(free) == len(set(free)), f"free queue has duplicates: {free}"
    assert not used & set(free), f"blocks both free and used: {sorted(used & set(free))}"
    assert used | set(free) == set(range(num_blocks))

    holders = [0] * num_blocks
    for seq in live:
        assert len(seq.block_table) == len(set(seq.block_table)), (
            f"seq {seq.seq_id} holds a block twice"
        )
        for block_id in seq.block_table:
            holders[block_id] += 1
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], (
            f"block {block.block_id}: ref_count {block.ref_count}, "
            f"held by {holders[block.block_id]} tables"
        )
        assert (block.ref_count > 0) == (block.block_id in used)

    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h, f"map entry {h} -> {block_id} is stale"
        assert len(bm.blocks[block_id].token_ids) == bm.block_size

    # A block a sequence holds stores exactly that sequence's tokens: computed full blocks carry
    # the reference chain hash, everything after them is not hashed yet.
    for seq in live:
        if not seq.block_table:
            continue
        chain = expected_chain(seq.token_ids[: seq.num_known_tokens], bm.block_size)
        num_full = (
            min(seq.num_cached_tokens, seq.num_known_tokens) // bm.block_size
        )  # placeholders are not hashed
        for i, block_id in enumerate(seq.block_table):
            block = bm.blocks[block_id]
            if i < num_full:
                assert block.hash == chain[i], (
                    f"seq {seq.seq_id} block {i} (id {block_id}) has a wrong hash"
                )
                assert block.token_ids == seq.block(i)
            else:
                assert block.hash == -1, (
                    f"seq {seq.seq_id} block {i} (id {block_id}) hashed before it is full"
                )


def check_scheduler_invariants(sched: Scheduler) -> None:
    """Queue states plus the BlockManager invariants over every live sequence."""
    waiting, running = list(sched.waiting), list(sched.running)
    ids = [s.seq_id for s in waiting + running]
    assert len(ids) == len(set(ids)), "a sequence is queued twice"
    assert len(running) <= sched.max_num_seqs
    # FIFO: a preempted sequence is older than every request that never ran, and the newest
    # running sequence is preempted first, so both queues stay in arrival (seq id) order.
    assert [s.seq_id for s in waiting] == sorted(s.seq_id for s in waiting), "waiting out of order"
    assert [s.seq_id for s in running] == sorted(s.seq_id for s in running), "running out of order"
    bs = sched.block_manager.block_size
    for i, seq in enumerate(waiting):
        assert seq.status == SequenceStatus.WAITING
        assert seq.num_scheduled_tokens == 0
        if seq.block_table:
            assert i == 0, (
                f"waiting[{i}] (seq {seq.seq_id}) holds blocks; only the head of waiting may"
            )
            assert len(seq.block_table) == seq.num_blocks
            assert 0 < seq.num_cached_tokens < len(seq)
        else:
            assert seq.num_cached_tokens == 0
    for seq in running:
        assert seq.status == SequenceStatus.RUNNING
        assert seq.num_scheduled_tokens == 0
        # Every token but the newest (sampled, not yet fed back) has its KV in the cache.
        assert seq.num_cached_tokens == len(seq) - 1
        assert len(seq.block_table) == -(-seq.num_cached_tokens // bs)
    check_block_invariants(sched.block_manager, waiting + running)


def append_token(seq: Sequence, token_id: int) -> None:
    """Append a known token (a sampled one whose value has arrived)."""
    seq.append_placeholder(-1)
    seq.set_token(seq.num_tokens - 1, token_id)


def run_step(sched: Scheduler, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
    """A step whose tokens are known when it ends: ``advance``, then ``resolve``; returns the
    sequences that finished."""
    return sched.resolve(seqs, sched.advance(seqs), token_ids)
