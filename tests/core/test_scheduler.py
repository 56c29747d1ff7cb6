"""Scheduler: prefill/decode steps, chunked prefill, preemption, limits and finishing, driven
with fake sampled tokens. Block size 4 unless stated; block ids worked out by hand from the free
queue order (a fresh pool hands out 0, 1, 2, ...; freed blocks join the back, newest first).
"""

from core_helpers import (
    check_scheduler_invariants,
    expected_chain,
    expected_hash,
    free_queue,
    make_scheduler,
    make_seq,
    run_step,
)

from nanovllm.engine.sequence import Sequence, SequenceStatus

WAITING, RUNNING, FINISHED = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED


def scheduled_tokens(seqs: list[Sequence]) -> list[int]:
    return [s.num_scheduled_tokens for s in seqs]


# ---- prefill and decode ----------------------------------------------------------------------


def test_prefill_then_decode():
    sched = make_scheduler(num_blocks=8)
    a = make_seq([1, 2, 3, 4, 5])
    b = make_seq([11, 12, 13])
    sched.add(a)
    sched.add(b)

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a, b], True)
    assert scheduled_tokens(seqs) == [5, 3]
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert list(sched.running) == [a, b] and not sched.waiting
    assert a.status == RUNNING and b.status == RUNNING

    assert run_step(sched, seqs, [100, 101]) == []
    assert a.token_ids == [1, 2, 3, 4, 5, 100] and b.token_ids == [11, 12, 13, 101]
    assert a.completion_token_ids == [100]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (5, 3)
    assert sched.block_manager.blocks[0].hash == expected_hash([1, 2, 3, 4])
    assert sched.block_manager.blocks[2].hash == -1  # b's block is not full yet
    check_scheduler_invariants(sched)

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a, b], False)
    assert scheduled_tokens(seqs) == [1, 1]
    assert a.block_table == [0, 1] and b.block_table == [2]
    run_step(sched, seqs, [102, 103])
    # b's block filled by its decoded token is hashed after the step that wrote its KV.
    assert sched.block_manager.blocks[2].hash == expected_hash([11, 12, 13, 101])
    assert a.token_ids == [1, 2, 3, 4, 5, 100, 102] and b.token_ids == [11, 12, 13, 101, 103]
    check_scheduler_invariants(sched)


def test_decode_adds_a_block_exactly_one_past_the_boundary():
    sched = make_scheduler(num_blocks=4)
    seq = make_seq([1, 2, 3, 4], max_tokens=10)
    sched.add(seq)
    seqs, _ = sched.schedule()
    assert seq.block_table == [0]
    run_step(sched, seqs, [5])
    table_sizes = []
    for token in range(6, 11):  # decode steps at lengths 5, 6, 7, 8, 9
        length = len(seq)
        seqs, is_prefill = sched.schedule()
        assert seqs == [seq] and not is_prefill
        table_sizes.append((length, list(seq.block_table)))
        run_step(sched, seqs, [token])
        check_scheduler_invariants(sched)
    assert table_sizes == [(5, [0, 1]), (6, [0, 1]), (7, [0, 1]), (8, [0, 1]), (9, [0, 1, 2])]
    assert sched.block_manager.blocks[1].hash == expected_chain(list(range(1, 9)), 4)[1]


def test_waiting_queue_is_fifo_even_when_a_later_request_would_fit():
    sched = make_scheduler(num_blocks=4)
    x = make_seq(list(range(1, 9)))  # 2 blocks
    sched.add(x)
    seqs, _ = sched.schedule()
    run_step(sched, seqs, [9])
    big = make_seq(list(range(20, 32)))  # needs 3 blocks, only 2 free
    small = make_seq([40, 41])  # would fit
    sched.add(big)
    sched.add(small)
    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([x], False)
    assert list(sched.waiting) == [big, small]
    assert small.block_table == []


# ---- token budget and chunked prefill ---------------------------------------------------------


def test_long_prompt_is_chunked_and_holds_its_blocks_at_head_of_waiting():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=6)
    a = make_seq(list(range(100, 110)))  # 10 tokens
    b = make_seq([7, 8, 9])
    sched.add(a)
    sched.add(b)

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a], True)  # b is not admitted after a chunk
    assert scheduled_tokens(seqs) == [6]
    assert a.block_table == [0, 1, 2]  # blocks for the whole prompt
    assert list(sched.waiting) == [a, b] and not sched.running
    assert a.status == WAITING
    assert run_step(sched, seqs, [999]) == []
    assert a.token_ids == list(range(100, 110))  # no token for an unfinished prompt
    assert a.num_cached_tokens == 6
    assert sched.block_manager.blocks[0].hash == expected_hash([100, 101, 102, 103])
    assert sched.block_manager.blocks[1].hash == -1
    check_scheduler_invariants(sched)

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a], True)  # b (3 tokens) does not fit in the 2 left
    assert scheduled_tokens(seqs) == [4]
    assert a.status == RUNNING
    assert list(sched.waiting) == [b] and list(sched.running) == [a]
    run_step(sched, seqs, [50])
    assert a.completion_token_ids == [50]
    assert a.num_cached_tokens == 10
    assert sched.block_manager.blocks[1].hash == expected_chain(list(range(100, 110)), 4)[1]
    check_scheduler_invariants(sched)

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([b], True)
    assert scheduled_tokens(seqs) == [3]
    assert b.block_table == [3]
    run_step(sched, seqs, [60])

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a, b], False)
    assert scheduled_tokens(seqs) == [1, 1]


def test_second_prompt_that_does_not_fit_the_rest_of_the_budget_waits_whole():
    sched = make_scheduler(max_num_batched_tokens=6)
    a, b, c = make_seq([1, 2, 3]), make_seq([4, 5]), make_seq([6, 7])
    for s in (a, b, c):
        sched.add(s)
    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a, b], True)
    assert scheduled_tokens(seqs) == [3, 2]
    assert list(sched.waiting) == [c] and c.block_table == []


def test_only_uncached_tokens_count_against_the_budget():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=6)
    prefix = [11, 12, 13, 14, 21, 22, 23, 24]
    a = make_seq(prefix)
    sched.add(a)
    seqs, _ = sched.schedule()
    assert scheduled_tokens(seqs) == [6]
    run_step(sched, seqs, [0])
    seqs, _ = sched.schedule()
    assert scheduled_tokens(seqs) == [2]
    run_step(sched, seqs, [1])

    b = make_seq(prefix + [5, 6, 7, 8])  # 12 tokens, 8 cached: fits the budget of 6 whole
    sched.add(b)
    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([b], True)
    assert scheduled_tokens(seqs) == [4]
    assert b.block_table == [0, 1, 2]
    assert b.num_cached_tokens == 8 and b.num_prefix_hit_tokens == 8
    assert [sched.block_manager.blocks[i].ref_count for i in range(3)] == [2, 2, 1]
    run_step(sched, seqs, [9])
    check_scheduler_invariants(sched)


# ---- preemption --------------------------------------------------------------------------------


def test_decode_preempts_newest_running_sequence_to_head_of_waiting():
    sched = make_scheduler(num_blocks=4, max_num_seqs=3)
    a = make_seq([1, 2, 3, 4])  # block 0; its next token starts a new block
    b = make_seq([5, 6, 7])  # block 1
    c = make_seq([8, 9, 10, 11, 12, 13])  # blocks 2, 3
    d = make_seq([14, 15])  # over max_num_seqs: waits
    for s in (a, b, c, d):
        sched.add(s)
    seqs, _ = sched.schedule()
    assert seqs == [a, b, c]
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2, 3])
    run_step(sched, seqs, [20, 21, 22])
    assert free_queue(sched.block_manager) == []

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a, b], False)
    assert list(sched.waiting) == [c, d]
    assert list(sched.running) == [a, b]
    assert c.status == WAITING and c.block_table == [] and c.num_cached_tokens == 0
    assert a.block_table == [0, 3]  # c's blocks were released newest first: 3, then 2
    assert free_queue(sched.block_manager) == [2]
    assert sched.block_manager.blocks[2].hash == expected_hash([8, 9, 10, 11])  # remembered
    run_step(sched, seqs, [30, 31])
    check_scheduler_invariants(sched)
    assert c.token_ids == [8, 9, 10, 11, 12, 13, 22]  # its sampled token is kept


def test_sequence_preempts_itself_when_no_other_is_left():
    sched = make_scheduler(num_blocks=3)
    b = make_seq([1, 2, 3, 4], max_tokens=4)
    a = make_seq([5, 6, 7, 8])
    sched.add(b)
    sched.add(a)
    seqs, _ = sched.schedule()
    assert (b.block_table, a.block_table) == ([0], [1])
    run_step(sched, seqs, [9, 10])

    seqs, is_prefill = sched.schedule()  # b takes the last free block; a has nobody to preempt
    assert (seqs, is_prefill) == ([b], False)
    assert b.block_table == [0, 2]
    assert list(sched.waiting) == [a] and a.block_table == [] and a.status == WAITING
    assert list(sched.running) == [b]
    assert free_queue(sched.block_manager) == [1]
    run_step(sched, seqs, [11])
    check_scheduler_invariants(sched)

    # a (5 tokens, block 1 remembered) needs 2 blocks; it waits until b finishes.
    for token in (12, 13):
        seqs, is_prefill = sched.schedule()
        assert (seqs, is_prefill) == ([b], False)
        finished = run_step(sched, seqs, [token])
    assert finished == [b] and b.completion_token_ids == [9, 11, 12, 13]
    assert free_queue(sched.block_manager) == [1, 2, 0]

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a], True)
    assert a.block_table == [1, 2]  # its computed prompt block comes back out of the free queue
    assert a.num_cached_tokens == 4 and scheduled_tokens(seqs) == [1]
    run_step(sched, seqs, [14])
    assert a.token_ids == [5, 6, 7, 8, 10, 14]
    check_scheduler_invariants(sched)


def test_preempted_sequence_is_recomputed_from_its_cached_prefix():
    sched = make_scheduler(num_blocks=3)
    a = make_seq([1, 2, 3, 4], max_tokens=2)
    b = make_seq([11, 12, 13, 14, 15, 16, 17, 18])
    sched.add(a)
    sched.add(b)
    seqs, _ = sched.schedule()
    assert (a.block_table, b.block_table) == ([0], [1, 2])
    run_step(sched, seqs, [5, 19])

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a], False)
    assert list(sched.waiting) == [b]
    assert a.block_table == [0, 2]  # b released 2 then 1; a reused 2 and dropped its hash
    h = expected_chain(b.prompt_token_ids, 4)
    assert sched.block_manager.hash_to_block_id == {expected_hash([1, 2, 3, 4]): 0, h[0]: 1}
    assert run_step(sched, seqs, [6]) == [a]
    assert free_queue(sched.block_manager) == [1, 2, 0]

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([b], True)
    assert b.block_table == [1, 2, 0]
    assert b.num_cached_tokens == 4  # block 1 still held b's first 4 tokens
    assert scheduled_tokens(seqs) == [5]  # tokens 4..8: the rest of the prompt and token 19
    assert b.num_prefix_hit_tokens == 0  # reported hits are those of the first admission
    run_step(sched, seqs, [20])
    assert b.completion_token_ids == [19, 20]
    check_scheduler_invariants(sched)


# ---- limits and finishing ----------------------------------------------------------------------


def test_max_num_seqs_limits_running_sequences():
    sched = make_scheduler(max_num_seqs=2)
    a = make_seq([1, 2, 3], max_tokens=2)
    b = make_seq([4, 5, 6])
    c = make_seq([7, 8, 9])
    for s in (a, b, c):
        sched.add(s)
    seqs, _ = sched.schedule()
    assert seqs == [a, b] and list(sched.waiting) == [c]
    run_step(sched, seqs, [10, 11])
    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a, b], False)  # c waits although blocks are free
    assert run_step(sched, seqs, [12, 13]) == [a]
    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([c], True)
    run_step(sched, seqs, [14])
    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([b, c], False)


def test_eos_finishes_and_frees_unless_ignore_eos():
    sched = make_scheduler(num_blocks=4, eos_token_id=2)
    a = make_seq([5, 6, 7, 8, 9])
    b = make_seq([5, 6, 7], ignore_eos=True)
    sched.add(a)
    sched.add(b)
    seqs, _ = sched.schedule()
    assert run_step(sched, seqs, [2, 2]) == [a]
    assert a.status == FINISHED and a.is_finished
    assert a.block_table == [] and a.completion_token_ids == [2]
    assert list(sched.running) == [b] and b.status == RUNNING
    assert free_queue(sched.block_manager) == [3, 1, 0]
    check_scheduler_invariants(sched)


def test_any_of_several_eos_ids_finishes():
    sched = make_scheduler(eos_token_id=[7, 9])
    a, b, c = make_seq([1]), make_seq([2]), make_seq([3])
    for s in (a, b, c):
        sched.add(s)
    seqs, _ = sched.schedule()
    assert run_step(sched, seqs, [9, 8, 7]) == [a, c]
    assert list(sched.running) == [b]


def test_no_eos_id_never_finishes_on_a_token():
    sched = make_scheduler(eos_token_id=None)
    a = make_seq([1], max_tokens=2)
    sched.add(a)
    seqs, _ = sched.schedule()
    assert run_step(sched, seqs, [0]) == []


def test_max_tokens_finishes_after_exactly_that_many_tokens():
    sched = make_scheduler(eos_token_id=0)
    a = make_seq([1, 2, 3], max_tokens=3)
    sched.add(a)
    steps = 0
    while not sched.is_finished():
        seqs, _ = sched.schedule()
        run_step(sched, seqs, [40 + steps])
        steps += 1
    assert steps == 3
    assert a.completion_token_ids == [40, 41, 42] and a.status == FINISHED


def test_max_model_len_finishes_the_sequence():
    sched = make_scheduler(max_model_len=8)
    a = make_seq([1, 2, 3, 4, 5], max_tokens=100)
    sched.add(a)
    finished = []
    while not finished:
        seqs, _ = sched.schedule()
        finished = run_step(sched, seqs, [6])
    assert finished == [a] and len(a) == 8 and a.completion_token_ids == [6, 6, 6]
    assert free_queue(sched.block_manager) == list(range(2, 16)) + [1, 0]
