"""Decides what each step computes: prefill first, FIFO, chunked prompts and preemption."""

from collections import deque

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """``waiting``: prompts not fully computed (a chunked prefill holds blocks, first after any
    that a processor holds back); ``running``: sequences in decode. Both FIFO."""

    def __init__(self, config, num_blocks: int, eos_token_ids: list[int]):
        """``config``: ``Config``'s limits and block size."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.kvcache_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_generated_tokens = 0  # sampled tokens kept (not those computed past an end)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Prefill: waiting sequences in order within the limits, only the last chunked. Else every
        running one decodes a token (the newest preempted when blocks run out), longest first."""
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        num_seqs = len(self.running)  # a chunked prefill in progress counts from its admission
        held = []  # held back by a processor (a LoRA adapter waiting for a slot): others pass
        while self.waiting and budget > 0 and num_seqs < self.max_num_seqs:
            seq = self.waiting[0]
            lead = seq.wait_for  # completion 0: it computes the prompt's blocks, hit them next step
            if lead in scheduled and lead.num_cached_tokens < lead.num_prompt_tokens:
                break
            if seq.block_table:  # a chunked prefill in progress
                num_uncached = len(seq) - seq.num_cached_tokens
            else:
                hits = bm.cached_prefix(seq)  # one prefix walk serves the three questions
                num_uncached = len(seq) - len(hits) * bm.block_size
                if (scheduled and num_uncached > budget) or not bm.can_allocate(seq, hits):
                    break
                if seq.processors and not all([p.admit(seq) for p in seq.processors]):
                    held.append(self.waiting.popleft())
                    continue
                bm.allocate(seq, hits)
            seq.num_scheduled_tokens = min(num_uncached, budget)
            budget -= seq.num_scheduled_tokens
            num_seqs += 1
            scheduled.append(seq)
            if seq.num_scheduled_tokens < num_uncached:
                break  # chunked: the rest of its prompt waits for the next step
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        self.waiting.extendleft(reversed(held))
        if scheduled:
            return scheduled, True

        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                bm.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        # longest first: the decode kernels start their longest programs first
        return sorted(scheduled, key=len, reverse=True), False

    def at_length_limit(self, seq: Sequence) -> bool:
        return seq.num_completion_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len

    def preempt(self, seq: Sequence, count: bool = True) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += count

    def unschedule(self, seqs: list[Sequence]) -> None:
        for seq in reversed(seqs):
            if not seq.is_finished:
                (self.running if seq.status == SequenceStatus.RUNNING else self.waiting).remove(seq)
                self.preempt(seq, count=False)

    def finish(self, seq: Sequence, finish_reason: str, stop_reason: int | None = None) -> None:
        if seq.is_finished:
            return
        queue = self.running if seq.status == SequenceStatus.RUNNING else self.waiting
        if seq in queue:  # not when its last token is in flight (see ``advance``)
            queue.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
        seq.num_scheduled_tokens = 0
        seq.wait_for = None
        seq.discard_pending()
        self.block_manager.deallocate(seq)

    def check_stop(self, seq: Sequence, token_id: int) -> tuple[str, int | None] | None:
        """EOS or a stop token once ``min_tokens`` are out, or the length limit."""
        if seq.num_known_tokens - seq.num_prompt_tokens > seq.min_tokens:
            if not seq.ignore_eos and token_id in self.eos_token_ids:
                return "stop", None
            if token_id in seq.stop_token_ids:
                return "stop", token_id
        if seq.num_known_tokens == seq.num_tokens and self.at_length_limit(seq):
            return "length", None
        return None

    def advance(self, seqs: list[Sequence]) -> list[int]:
        """A step is launched: placeholders for its samples; their positions (-1: prompt chunk)."""
        positions = []
        for row, seq in enumerate(seqs):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(seq)
            if seq.num_cached_tokens < len(seq):
                positions.append(-1)
                continue
            seq.append_placeholder(row)
            positions.append(len(seq) - 1)
            if self.at_length_limit(seq):
                self.running.remove(seq)
                self.block_manager.deallocate(seq)
        return positions

    def resolve(self, seqs: list[Sequence], positions: list[int], token_ids: list[int]) -> list:
        """The tokens into their positions (past an end: dropped); the sequences that finished."""
        finished = []
        for seq, position, token_id in zip(seqs, positions, token_ids):
            if not 0 <= position < len(seq) or seq.is_finished:
                continue
            seq.set_token(position, token_id)
            ended = seq.processors and any([p.accept(seq, token_id) for p in seq.processors])
            stop = ("stop", None) if ended else None
            self.num_generated_tokens += 1
            self.block_manager.hash_blocks(seq)
            if stop is not None or (stop := self.check_stop(seq, token_id)) is not None:
                self.finish(seq, *stop)
                finished.append(seq)
        return finished
