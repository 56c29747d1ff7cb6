"""The block manager of a hybrid model: besides its KV blocks, a sequence holds a slot for the
recurrent states of the linear-attention layers, from its first block to its last."""

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence


class StateSlotBlockManager(BlockManager):
    """``num_slots`` state slots (more than sequences can hold blocks at once). No prefix cache:
    a cached prefix would also need the recurrent states at its end."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int):
        super().__init__(num_blocks, block_size)
        self.free_slots = list(range(num_slots))
        self.caching = False

    def allocate(self, seq: Sequence, hits: list[int] | None = None) -> None:
        super().allocate(seq, hits)
        seq.state_slot = self.free_slots.pop()  # its states start at token 0, with its blocks

    def deallocate(self, seq: Sequence) -> None:
        super().deallocate(seq)
        if seq.state_slot >= 0:  # a preempted sequence recomputes its states
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1
