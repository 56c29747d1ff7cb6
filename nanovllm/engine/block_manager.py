"""Paged KV-cache blocks with reference counts and a hash-chained prefix cache."""

from collections import OrderedDict

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # -1: not a full, hashed block
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash, self.token_ids = h, token_ids

    def reset(self) -> None:
        self.ref_count, self.hash, self.token_ids = 1, -1, []


class BlockManager:
    """A fixed pool of KV blocks; a freed block keeps its hash until handed out anew. Invariant:
    a used block's ``ref_count`` is the number of block tables holding it."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            msg = f"got {num_blocks} and {block_size}"
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, {msg}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.num_queried_tokens = self.num_hit_tokens = 0  # admitted tokens, and cache hits
        self.caching = True  # False: no prefix is looked up (enable_prefix_caching)

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        """Chained over the previous block's hash: it stands for the whole prefix."""
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.asarray(token_ids, dtype="<i8").tobytes())
        return h.intdigest()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The longest cached prefix's blocks, never the last block: a prefill computes a token."""
        if not (seq.uses_prefix_cache and self.caching):
            return []
        hits, h = [], seq.cache_salt
        for i in range(seq.num_blocks - 1):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
        return hits

    def reset_prefix_cache(self) -> None:
        self.hash_to_block_id.clear()
        for block_id in self.free_block_ids:
            self.blocks[block_id].update(-1, [])

    def can_allocate(self, seq: Sequence, hits: list[int] | None = None) -> bool:
        """Whether the free queue holds every block ``seq`` needs beyond its cached ``hits``."""
        hits = self.cached_prefix(seq) if hits is None else hits
        needed = seq.num_blocks - sum(self.blocks[b].ref_count > 0 for b in hits)
        return needed <= self.num_free_blocks

    def allocate(self, seq: Sequence, hits: list[int] | None = None) -> None:
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        hits = self.cached_prefix(seq) if hits is None else hits
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
                self.used_block_ids.add(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(seq.num_blocks - len(hits)):
            seq.block_table.append(self._take_free_block())
        seq.num_cached_tokens = len(hits) * self.block_size
        self.num_queried_tokens += len(seq)
        self.num_hit_tokens += seq.num_cached_tokens
        if seq.num_prefix_hit_tokens < 0:
            seq.num_prefix_hit_tokens = seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids[block_id] = None
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= (seq.num_blocks > len(seq.block_table))

    def may_append(self, seq: Sequence) -> None:
        if len(seq.block_table) < seq.num_blocks:  # the newest token's KV starts a block
            seq.block_table.append(self._take_free_block())

    def hash_blocks(self, seq: Sequence) -> None:
        """A block is hashed once computed, known tokens fill it."""
        num_full = min(seq.num_cached_tokens, seq.num_known_tokens) // self.block_size
        start = num_full
        while start > 0 and self.blocks[seq.block_table[start - 1]].hash == -1:
            start -= 1
        h = self.blocks[seq.block_table[start - 1]].hash if start > 0 else seq.cache_salt
        for i in range(start, num_full):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = seq.block_table[i]
            self.blocks[block_id].update(h, token_ids)
            self.hash_to_block_id[h] = block_id
