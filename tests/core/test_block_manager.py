"""BlockManager: exact block ids, reference counts, prefix-cache hits, eviction order and hashing.

Block size 4 throughout unless stated; expected block ids are worked out by hand from the free
queue order (a fresh pool hands out 0, 1, 2, ...; freed blocks join the back of the queue).
"""

import pytest
from core_helpers import (
    append_token,
    check_block_invariants,
    compute,
    expected_chain,
    expected_hash,
    free_queue,
    make_seq,
)

from nanovllm.engine.block_manager import BlockManager

PREFIX = [11, 12, 13, 14, 21, 22, 23, 24]  # two full blocks


# ---- hashing ---------------------------------------------------------------------------------


def test_hash_is_xxh64_over_prev_hash_and_int64_tokens():
    first = [1, 2, 3, 151643]
    second = [2**40, 0, 7, 9]
    h0 = BlockManager.compute_hash(first)
    assert h0 == expected_hash(first)
    assert BlockManager.compute_hash(second, h0) == expected_hash(second, h0)
    # The chain makes a block's hash depend on everything before it.
    assert BlockManager.compute_hash(second, h0) != BlockManager.compute_hash(second)


def test_full_blocks_are_hashed_and_registered_when_computed():
    bm = BlockManager(8, 4)
    seq = make_seq(list(range(100, 110)))  # 10 tokens: 2 full blocks + 2 tokens
    bm.allocate(seq)
    assert seq.block_table == [0, 1, 2]
    assert [bm.blocks[b].hash for b in range(3)] == [-1, -1, -1]  # nothing computed yet

    h = expected_chain(seq.token_ids, 4)
    compute(bm, seq, 6)  # a chunk: only block 0 is full
    assert [bm.blocks[b].hash for b in range(3)] == [h[0], -1, -1]
    assert bm.hash_to_block_id == {h[0]: 0}

    compute(bm, seq, 4)  # the rest of the prompt fills block 1
    assert [bm.blocks[b].hash for b in range(3)] == [h[0], h[1], -1]
    assert bm.blocks[1].token_ids == [104, 105, 106, 107]
    assert bm.hash_to_block_id == {h[0]: 0, h[1]: 1}


def test_block_filled_by_decoded_tokens_is_hashed():
    bm = BlockManager(4, 4)
    seq = make_seq([5, 6, 7])
    bm.allocate(seq)
    compute(bm, seq)
    append_token(seq, 8)  # decoded token completes block 0 once its KV is written
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert seq.block_table == [0]
    assert bm.blocks[0].hash == -1
    compute(bm, seq)
    assert bm.blocks[0].hash == expected_hash([5, 6, 7, 8])
    assert bm.hash_to_block_id == {expected_hash([5, 6, 7, 8]): 0}


# ---- allocation ------------------------------------------------------------------------------


def test_allocate_from_fresh_pool_takes_front_of_free_queue():
    bm = BlockManager(8, 4)
    a = make_seq(list(range(10)))  # 3 blocks
    b = make_seq(list(range(50, 55)))  # 2 blocks
    assert bm.can_allocate(a)
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3, 4]
    assert free_queue(bm) == [5, 6, 7]
    assert bm.used_block_ids == {0, 1, 2, 3, 4}
    assert [bm.blocks[i].ref_count for i in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    check_block_invariants(bm, [a, b])


def test_can_allocate_counts_blocks_exactly():
    bm = BlockManager(3, 4)
    assert bm.can_allocate(make_seq(list(range(12))))  # 3 blocks
    assert not bm.can_allocate(make_seq(list(range(13))))  # 4 blocks


def test_allocating_a_sequence_that_already_holds_blocks_is_rejected():
    bm = BlockManager(4, 4)
    seq = make_seq([1, 2, 3])
    bm.allocate(seq)
    with pytest.raises(AssertionError):
        bm.allocate(seq)


def test_invalid_pool_is_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


# ---- prefix hits -----------------------------------------------------------------------------


def test_prefix_not_yet_computed_is_not_a_hit():
    bm = BlockManager(8, 4)
    a = make_seq(PREFIX + [1, 2])
    b = make_seq(PREFIX + [3, 4])
    bm.allocate(a)
    bm.allocate(b)  # a's blocks are not hashed until a step computes them
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3, 4, 5]
    assert b.num_cached_tokens == 0


def test_shared_full_blocks_are_hits_and_ref_counts_go_up():
    bm = BlockManager(8, 4)
    a = make_seq(PREFIX + [1, 2])
    bm.allocate(a)
    compute(bm, a)
    b = make_seq(PREFIX + [3, 4, 5])
    assert bm.cached_prefix(b) == [0, 1]
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert b.num_prefix_hit_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert free_queue(bm) == [4, 5, 6, 7]
    check_block_invariants(bm, [a, b])

    # Block 1's tokens after a different block 0 are not a hit: the hash chains the whole prefix.
    c = make_seq([99] + PREFIX[1:] + [1, 2])
    bm.allocate(c)
    assert c.block_table == [4, 5, 6]
    assert c.num_cached_tokens == 0

    bm.deallocate(a)  # shared blocks stay in use while b holds them
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 0, 1]
    assert free_queue(bm) == [7, 2]
    assert 0 not in bm.free_block_ids and 1 not in bm.free_block_ids
    check_block_invariants(bm, [b, c])


def test_last_block_of_prompt_is_never_a_hit():
    bm = BlockManager(8, 4)
    a = make_seq(PREFIX)  # exactly two blocks
    bm.allocate(a)
    compute(bm, a)
    assert len(bm.hash_to_block_id) == 2

    b = make_seq(PREFIX)  # the same prompt: only block 0 is served from the cache
    assert bm.cached_prefix(b) == [0]
    bm.allocate(b)
    assert b.block_table == [0, 2]
    assert b.num_cached_tokens == 4

    c = make_seq(PREFIX[:4])  # a one-block prompt is never a hit
    assert bm.cached_prefix(c) == []
    bm.allocate(c)
    assert c.block_table == [3]
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 1, 1, 1]


def test_hash_match_with_different_stored_tokens_is_a_miss():
    bm = BlockManager(8, 4)
    a = make_seq(PREFIX + [1])
    bm.allocate(a)
    compute(bm, a)
    bm.blocks[0].token_ids = [0, 0, 0, 0]  # same hash, different content
    b = make_seq(PREFIX + [2])
    assert bm.cached_prefix(b) == []
    bm.allocate(b)
    assert b.block_table == [3, 4, 5]  # the miss on block 0 ends the walk; block 1 is not tried
    assert [bm.blocks[i].ref_count for i in range(6)] == [1, 1, 1, 1, 1, 1]


def test_colliding_hash_is_a_miss_unless_tokens_match(monkeypatch):
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda token_ids, prefix=-1: 42))
    bm = BlockManager(8, 4)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute(bm, a)
    assert bm.hash_to_block_id == {42: 0}

    b = make_seq([5, 6, 7, 8, 9])  # collides with block 0
    bm.allocate(b)
    assert b.block_table == [2, 3]
    assert b.num_cached_tokens == 0

    c = make_seq([1, 2, 3, 4, 7])  # same hash and same tokens: a genuine hit
    bm.allocate(c)
    assert c.block_table == [0, 4]
    assert c.num_cached_tokens == 4
    assert bm.blocks[0].ref_count == 2


# ---- freed blocks, eviction order --------------------------------------------------------------


def test_deallocate_releases_newest_block_first_to_back_of_queue():
    bm = BlockManager(8, 4)
    a = make_seq(list(range(10)))
    b = make_seq(list(range(50, 55)))
    bm.allocate(a)
    bm.allocate(b)
    assert free_queue(bm) == [5, 6, 7]
    bm.deallocate(a)
    assert free_queue(bm) == [5, 6, 7, 2, 1, 0]
    assert a.block_table == [] and a.num_cached_tokens == 0
    bm.deallocate(b)
    assert free_queue(bm) == [5, 6, 7, 2, 1, 0, 4, 3]
    assert bm.used_block_ids == set()

    # Eviction takes the front of the queue: never-used blocks first, then in release order.
    c = make_seq(list(range(200, 220)))  # 5 blocks
    bm.allocate(c)
    assert c.block_table == [5, 6, 7, 2, 1]
    assert free_queue(bm) == [0, 4, 3]


def test_freed_blocks_keep_their_hash_and_are_taken_back_by_a_hit():
    bm = BlockManager(8, 4)
    a = make_seq(PREFIX + [1, 2])
    bm.allocate(a)
    compute(bm, a)
    h = expected_chain(PREFIX, 4)
    bm.deallocate(a)
    assert free_queue(bm) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert bm.blocks[0].hash == h[0] and bm.blocks[1].hash == h[1]
    assert bm.hash_to_block_id == {h[0]: 0, h[1]: 1}
    assert bm.blocks[0].ref_count == 0

    b = make_seq(PREFIX + [3, 4, 5])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]  # hits leave the free queue wherever they sit in it
    assert b.num_cached_tokens == 8
    assert free_queue(bm) == [4, 5, 6, 7, 2]
    assert bm.used_block_ids == {0, 1, 3}
    check_block_invariants(bm, [b])


def test_block_handed_out_for_new_content_forgets_its_hash():
    bm = BlockManager(4, 4)
    a = make_seq(PREFIX + [1])  # blocks 0, 1, 2
    bm.allocate(a)
    compute(bm, a)
    h = expected_chain(PREFIX, 4)
    bm.deallocate(a)
    assert free_queue(bm) == [3, 2, 1, 0]

    c = make_seq(list(range(300, 309)))  # 3 blocks of new content: 3, 2, 1
    bm.allocate(c)
    assert c.block_table == [3, 2, 1]
    assert bm.blocks[1].hash == -1 and bm.blocks[1].token_ids == []
    assert bm.hash_to_block_id == {h[0]: 0}  # block 1's entry is gone, block 0 still remembered

    d = make_seq(PREFIX + [2])
    assert bm.cached_prefix(d) == [0]  # block 0 hits, block 1 was overwritten
    assert not bm.can_allocate(d)  # needs block 0 plus 2 fresh ones; only block 0 is free
    bm.deallocate(c)
    assert free_queue(bm) == [0, 1, 2, 3]
    bm.allocate(d)
    assert d.block_table == [0, 1, 2]
    assert d.num_cached_tokens == 4
    check_block_invariants(bm, [d])


def test_stale_entry_of_a_duplicate_block_is_kept_for_the_live_one():
    bm = BlockManager(6, 4)
    a = make_seq(PREFIX[:4] + [1])
    b = make_seq(PREFIX[:4] + [2])
    bm.allocate(a)
    bm.allocate(b)  # admitted together: both compute block 0's content
    compute(bm, a)
    compute(bm, b)
    h0 = expected_hash(PREFIX[:4])
    assert bm.hash_to_block_id == {h0: 2}  # the later registration wins
    bm.deallocate(a)
    assert free_queue(bm) == [4, 5, 1, 0]
    c = make_seq(list(range(400, 412)))  # takes 4, 5, 1: block 0 keeps its hash but is unmapped
    bm.allocate(c)
    assert c.block_table == [4, 5, 1]
    d = make_seq(list(range(500, 504)))  # recycles block 0: must not drop block 2's entry
    bm.allocate(d)
    assert d.block_table == [0]
    assert bm.hash_to_block_id == {h0: 2}
    check_block_invariants(bm, [b, c, d])


def test_can_allocate_counts_free_remembered_hits_but_not_in_use_hits():
    bm = BlockManager(4, 4)
    a = make_seq(PREFIX + [1])
    bm.allocate(a)
    compute(bm, a)
    b = make_seq(PREFIX + [2])  # hits 0 and 1 (in use), needs 1 fresh block; 1 is free
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    bm.deallocate(a)
    bm.deallocate(b)
    assert free_queue(bm) == [2, 3, 1, 0]
    bm.allocate(make_seq(list(range(600, 604))))  # takes block 2
    e = make_seq(PREFIX + [3])  # hits free blocks 0 and 1, needs 1 more: 3 free blocks suffice
    assert bm.can_allocate(e)
    f = make_seq(PREFIX + [3, 4, 5, 6, 7])  # hits 0 and 1, needs 2 more: 4 > 3 free
    assert not bm.can_allocate(f)


def test_reset_prefix_cache_forgets_every_hash_and_keeps_held_blocks():
    """Free blocks lose their content; a held block keeps its table entry and hash but is no hit,
    and the sequence holding it goes on hashing from it."""
    bm = BlockManager(8, 4)
    a = make_seq(PREFIX + [1])  # blocks 0, 1, 2
    b = make_seq([31, 32, 33, 34, 35])  # blocks 3, 4
    bm.allocate(a)
    bm.allocate(b)
    compute(bm, a)
    compute(bm, b)
    bm.deallocate(b)
    h = expected_chain(PREFIX, 4)
    assert bm.hash_to_block_id == {h[0]: 0, h[1]: 1, expected_hash([31, 32, 33, 34]): 3}

    bm.reset_prefix_cache()
    assert bm.hash_to_block_id == {}
    assert [bm.blocks[i].hash for i in (3, 4)] == [-1, -1] and bm.blocks[3].token_ids == []
    assert [bm.blocks[i].hash for i in (0, 1)] == h and a.block_table == [0, 1, 2]
    assert bm.blocks[0].ref_count == 1
    check_block_invariants(bm, [a])

    again = make_seq(PREFIX + [1])
    assert bm.cached_prefix(again) == []
    bm.allocate(again)
    assert again.block_table == [5, 6, 7] and again.num_cached_tokens == 0
    for token in (2, 3, 4):  # a fills block 2; its hash chains from block 1's
        append_token(a, token)
        bm.may_append(a)
        compute(bm, a)
    assert bm.blocks[2].hash == expected_hash([1, 2, 3, 4], h[1])
    assert bm.hash_to_block_id == {bm.blocks[2].hash: 2}
    check_block_invariants(bm, [a, again])


# ---- decode growth ---------------------------------------------------------------------------


def test_decode_needs_a_new_block_exactly_one_past_the_boundary():
    bm = BlockManager(3, 4)
    other = make_seq([7, 7, 7, 7, 7])
    bm.allocate(other)  # blocks 0, 1
    seq = make_seq([1, 2, 3])
    bm.allocate(seq)
    assert seq.block_table == [2]
    assert bm.num_free_blocks == 0
    compute(bm, seq)

    append_token(seq, 4)  # length 4: its newest token still fits block 2
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert seq.block_table == [2]
    compute(bm, seq)

    append_token(seq, 5)  # length 5: one past the boundary, needs a block
    assert not bm.can_append(seq)
    bm.deallocate(other)
    assert free_queue(bm) == [1, 0]
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert seq.block_table == [2, 1]
    compute(bm, seq)

    for token in (6, 7, 8):  # lengths 6..8 stay in block 1
        append_token(seq, token)
        bm.may_append(seq)
        assert seq.block_table == [2, 1]
        compute(bm, seq)
    assert bm.blocks[1].hash == expected_hash([5, 6, 7, 8], expected_hash([1, 2, 3, 4]))

    append_token(seq, 9)  # length 9
    bm.may_append(seq)
    assert seq.block_table == [2, 1, 0]
    check_block_invariants(bm, [seq])
