"""Scheduler: prefill/decode steps, chunked prefill, preemption, finishing, and randomized workloads
driven with fake sampled tokens. Block size 4 unless stated; block ids worked out by hand from the
free queue order (a fresh pool hands out 0, 1, 2, ...; freed blocks join the back, newest first).
"""
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from core_helpers import (
    check_block_invariants,
    check_scheduler_invariants,
    expected_chain,
    expected_hash,
    free_queue,
    make_scheduler,
    make_seq,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

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

    assert sched.postprocess(seqs, [100, 101]) == []
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
    sched.postprocess(seqs, [102, 103])
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
    sched.postprocess(seqs, [5])
    table_sizes = []
    for token in range(6, 11):  # decode steps at lengths 5, 6, 7, 8, 9
        length = len(seq)
        seqs, is_prefill = sched.schedule()
        assert seqs == [seq] and not is_prefill
        table_sizes.append((length, list(seq.block_table)))
        sched.postprocess(seqs, [token])
        check_scheduler_invariants(sched)
    assert table_sizes == [(5, [0, 1]), (6, [0, 1]), (7, [0, 1]), (8, [0, 1]), (9, [0, 1, 2])]
    assert sched.block_manager.blocks[1].hash == expected_chain(list(range(1, 9)), 4)[1]


def test_waiting_queue_is_fifo_even_when_a_later_request_would_fit():
    sched = make_scheduler(num_blocks=4)
    x = make_seq(list(range(1, 9)))  # 2 blocks
    sched.add(x)
    seqs, _ = sched.schedule()
    sched.postprocess(seqs, [9])
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
    assert sched.postprocess(seqs, [999]) == []
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
    sched.postprocess(seqs, [50])
    assert a.completion_token_ids == [50]
    assert a.num_cached_tokens == 10
    assert sched.block_manager.blocks[1].hash == expected_chain(list(range(100, 110)), 4)[1]
    check_scheduler_invariants(sched)

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([b], True)
    assert scheduled_tokens(seqs) == [3]
    assert b.block_table == [3]
    sched.postprocess(seqs, [60])

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
    sched.postprocess(seqs, [0])
    seqs, _ = sched.schedule()
    assert scheduled_tokens(seqs) == [2]
    sched.postprocess(seqs, [1])

    b = make_seq(prefix + [5, 6, 7, 8])  # 12 tokens, 8 cached: fits the budget of 6 whole
    sched.add(b)
    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([b], True)
    assert scheduled_tokens(seqs) == [4]
    assert b.block_table == [0, 1, 2]
    assert b.num_cached_tokens == 8 and b.num_prefix_hit_tokens == 8
    assert [sched.block_manager.blocks[i].ref_count for i in range(3)] == [2, 2, 1]
    sched.postprocess(seqs, [9])
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
    sched.postprocess(seqs, [20, 21, 22])
    assert free_queue(sched.block_manager) == []

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a, b], False)
    assert list(sched.waiting) == [c, d]
    assert list(sched.running) == [a, b]
    assert c.status == WAITING and c.block_table == [] and c.num_cached_tokens == 0
    assert a.block_table == [0, 3]  # c's blocks were released newest first: 3, then 2
    assert free_queue(sched.block_manager) == [2]
    assert sched.block_manager.blocks[2].hash == expected_hash([8, 9, 10, 11])  # remembered
    sched.postprocess(seqs, [30, 31])
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
    sched.postprocess(seqs, [9, 10])

    seqs, is_prefill = sched.schedule()  # b takes the last free block; a has nobody to preempt
    assert (seqs, is_prefill) == ([b], False)
    assert b.block_table == [0, 2]
    assert list(sched.waiting) == [a] and a.block_table == [] and a.status == WAITING
    assert list(sched.running) == [b]
    assert free_queue(sched.block_manager) == [1]
    sched.postprocess(seqs, [11])
    check_scheduler_invariants(sched)

    # a (5 tokens, block 1 remembered) needs 2 blocks; it waits until b finishes.
    for token in (12, 13):
        seqs, is_prefill = sched.schedule()
        assert (seqs, is_prefill) == ([b], False)
        finished = sched.postprocess(seqs, [token])
    assert finished == [b] and b.completion_token_ids == [9, 11, 12, 13]
    assert free_queue(sched.block_manager) == [1, 2, 0]

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a], True)
    assert a.block_table == [1, 2]  # its computed prompt block comes back out of the free queue
    assert a.num_cached_tokens == 4 and scheduled_tokens(seqs) == [1]
    sched.postprocess(seqs, [14])
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
    sched.postprocess(seqs, [5, 19])

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a], False)
    assert list(sched.waiting) == [b]
    assert a.block_table == [0, 2]  # b released 2 then 1; a reused 2 and dropped its hash
    h = expected_chain(b.prompt_token_ids, 4)
    assert sched.block_manager.hash_to_block_id == {expected_hash([1, 2, 3, 4]): 0, h[0]: 1}
    assert sched.postprocess(seqs, [6]) == [a]
    assert free_queue(sched.block_manager) == [1, 2, 0]

    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([b], True)
    assert b.block_table == [1, 2, 0]
    assert b.num_cached_tokens == 4  # block 1 still held b's first 4 tokens
    assert scheduled_tokens(seqs) == [5]  # tokens 4..8: the rest of the prompt and token 19
    assert b.num_prefix_hit_tokens == 0  # reported hits are those of the first admission
    sched.postprocess(seqs, [20])
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
    sched.postprocess(seqs, [10, 11])
    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([a, b], False)  # c waits although blocks are free
    assert sched.postprocess(seqs, [12, 13]) == [a]
    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([c], True)
    sched.postprocess(seqs, [14])
    seqs, is_prefill = sched.schedule()
    assert (seqs, is_prefill) == ([b, c], False)


def test_eos_finishes_and_frees_unless_ignore_eos():
    sched = make_scheduler(num_blocks=4, eos_token_id=2)
    a = make_seq([5, 6, 7, 8, 9])
    b = make_seq([5, 6, 7], ignore_eos=True)
    sched.add(a)
    sched.add(b)
    seqs, _ = sched.schedule()
    assert sched.postprocess(seqs, [2, 2]) == [a]
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
    assert sched.postprocess(seqs, [9, 8, 7]) == [a, c]
    assert list(sched.running) == [b]


def test_no_eos_id_never_finishes_on_a_token():
    sched = make_scheduler(eos_token_id=None)
    a = make_seq([1], max_tokens=2)
    sched.add(a)
    seqs, _ = sched.schedule()
    assert sched.postprocess(seqs, [0]) == []


def test_max_tokens_finishes_after_exactly_that_many_tokens():
    sched = make_scheduler(eos_token_id=0)
    a = make_seq([1, 2, 3], max_tokens=3)
    sched.add(a)
    steps = 0
    while not sched.is_finished():
        seqs, _ = sched.schedule()
        sched.postprocess(seqs, [40 + steps])
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
        finished = sched.postprocess(seqs, [6])
    assert finished == [a] and len(a) == 8 and a.completion_token_ids == [6, 6, 6]
    assert free_queue(sched.block_manager) == list(range(2, 16)) + [1, 0]


# ---- Sequence ----------------------------------------------------------------------------------


def test_sequence_blocks_and_derived_fields():
    seq = make_seq(list(range(10)), block_size=4)
    assert (seq.num_blocks, seq.last_block_num_tokens) == (3, 2)
    assert seq.block(0) == [0, 1, 2, 3] and seq.block(2) == [8, 9]
    with pytest.raises(IndexError):
        seq.block(3)
    seq.append_token(10)
    seq.append_token(11)
    assert (seq.num_blocks, seq.last_block_num_tokens) == (3, 4)
    assert seq.prompt_token_ids == list(range(10)) and seq.completion_token_ids == [10, 11]
    assert make_seq([1, 2, 3]).seq_id < make_seq([1, 2, 3]).seq_id


def test_sequence_pickles_only_the_scheduled_tokens():
    seq = make_seq(list(range(10)), block_size=4)
    seq.block_table = [3, 1, 2]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 4, 5  # a chunk: tokens 4..8
    chunk = pickle.loads(pickle.dumps(seq))
    assert chunk.scheduled_token_ids() == [4, 5, 6, 7, 8] and chunk.block_table == [3, 1, 2]
    assert (chunk.num_tokens, chunk.num_cached_tokens) == (10, 4)
    seq.num_cached_tokens, seq.num_scheduled_tokens = 9, 1  # the last prompt token
    assert pickle.loads(pickle.dumps(seq)).scheduled_token_ids() == [9]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 0, 10
    prefill = pickle.loads(pickle.dumps(seq))
    assert prefill.scheduled_token_ids() == list(range(10))
    seq.num_cached_tokens, seq.num_scheduled_tokens = 10, 1
    seq.append_token(42)
    decode = pickle.loads(pickle.dumps(seq))
    assert decode.token_ids == [] and decode.last_token == 42 and decode.scheduled_token_ids() == [42]
    assert (decode.num_tokens, decode.num_cached_tokens, decode.block_table) == (11, 10, [3, 1, 2])
    assert len(pickle.dumps(seq)) < len(pickle.dumps(prefill))


# ---- the core stays free of heavy imports ------------------------------------------------------


def test_engine_core_does_not_import_torch():
    code = (
        "import sys\n"
        "import nanovllm.engine.scheduler, nanovllm.engine.block_manager, nanovllm.engine.sequence\n"
        "import nanovllm.sampling_params\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'triton', 'flash_attn'))\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root)
    assert result.returncode == 0, f"engine core imported {result.stdout.strip()} {result.stderr}"


# ---- SamplingParams ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": float("inf")}, ValueError, "temperature"),
        ({"temperature": "0.7"}, TypeError, "temperature"),
        ({"temperature": None}, TypeError, "temperature"),
        ({"temperature": True}, TypeError, "temperature"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"max_tokens": -3}, ValueError, "max_tokens"),
        ({"max_tokens": 16.0}, TypeError, "max_tokens"),
        ({"max_tokens": True}, TypeError, "max_tokens"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos"),
        ({"ignore_eos": "yes"}, TypeError, "ignore_eos"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_good_values():
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    assert (p.temperature, p.max_tokens, p.ignore_eos) == (0.0, 1, True)
    assert isinstance(p.temperature, float)


# ---- randomized workloads ----------------------------------------------------------------------

EOS = 0


@st.composite
def workloads(draw):
    """Prompts built from two shared bases (so prefixes hit the cache), a pool just large enough
    for the longest request plus a little, and small budgets (so prefills chunk and decode
    preempts). Each request has a fixed plan of fake tokens, indexed by completion position, so
    a recomputed request samples the same tokens again."""
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    tokens = st.integers(1, 5)
    bases = [draw(st.lists(tokens, max_size=14)) for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 7))):
        base = bases[draw(st.integers(0, 1))]
        keep = draw(st.integers(0, len(base)))
        prompt = base[:keep] + draw(st.lists(tokens, min_size=0 if keep else 1, max_size=5))
        max_tokens = draw(st.integers(1, 10))
        plan = draw(st.lists(st.integers(0, 5), min_size=max_tokens, max_size=max_tokens))
        ignore_eos = draw(st.booleans())
        arrival = draw(st.integers(0, 6))
        requests.append((prompt, max_tokens, plan, ignore_eos, arrival))
    max_model_len = max(len(r[0]) for r in requests) + draw(st.integers(1, 8))
    need = max(math.ceil(min(len(p) + m, max_model_len) / block_size) for p, m, *_ in requests)
    config = dict(
        num_blocks=need + draw(st.sampled_from([0, 0, 1, 2, 4])),
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=draw(st.integers(1, 20)),
        max_model_len=max_model_len,
        eos_token_id=draw(st.sampled_from([EOS, None, [EOS, 99]])),
    )
    return config, requests


def expected_completion(plan, max_tokens, ignore_eos, prompt_len, max_model_len, eos_ids):
    n = min(max_tokens, max_model_len - prompt_len)
    if not ignore_eos:
        for i, token in enumerate(plan[:n]):
            if token in eos_ids:
                return plan[: i + 1]
    return plan[:n]


def check_step(sched, seqs, is_prefill):
    """What one scheduled step may contain, before its results are recorded."""
    assert seqs, "no progress although requests are pending"
    assert len(seqs) <= sched.max_num_seqs
    assert len({s.seq_id for s in seqs}) == len(seqs)
    for seq in seqs:
        assert len(seq.block_table) == seq.num_blocks
    if is_prefill:
        assert sum(s.num_scheduled_tokens for s in seqs) <= sched.max_num_batched_tokens
        chunked = [s for s in seqs if s.num_cached_tokens + s.num_scheduled_tokens < len(s)]
        assert all(s.num_scheduled_tokens >= 1 for s in seqs)
        assert all(s.num_cached_tokens + s.num_scheduled_tokens <= len(s) for s in seqs)
        assert not chunked or seqs == chunked, "only a step's single sequence may be chunked"
        if chunked:
            assert sched.waiting[0] is chunked[0] and chunked[0].status == WAITING
    else:
        # the head of running (FIFO), listed longest context first
        assert {id(s) for s in seqs} == {id(s) for s in list(sched.running)[: len(seqs)]}
        assert [len(s) for s in seqs] == sorted((len(s) for s in seqs), reverse=True)
        assert all(s.num_scheduled_tokens == 1 and s.num_cached_tokens == len(s) - 1 for s in seqs)
    check_block_invariants(sched.block_manager, list(sched.waiting) + list(sched.running))


def build_workload(config: dict, requests: list) -> tuple[list, dict]:
    """``(arrival, sequence, plan)`` in arrival order (so FIFO order is seq id order), and each
    sequence's plan by seq id."""
    seqs_by_arrival = [
        (arrival, make_seq(prompt, block_size=config["block_size"], max_tokens=m, ignore_eos=ig), plan)
        for prompt, m, plan, ig, arrival in sorted(requests, key=lambda r: r[4])
    ]
    return seqs_by_arrival, {seq.seq_id: plan for _, seq, plan in seqs_by_arrival}


def check_workload_done(sched, config: dict, seqs_by_arrival: list) -> None:
    """Every block free, every sequence finished with exactly its plan's completion."""
    eos = config["eos_token_id"]
    eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    bm = sched.block_manager
    assert sorted(bm.free_block_ids) == list(range(config["num_blocks"])) and not bm.used_block_ids
    assert all(block.ref_count == 0 for block in bm.blocks)
    for _, seq, plan in seqs_by_arrival:
        assert seq.status == FINISHED and seq.num_pending == 0
        assert seq.completion_token_ids == expected_completion(
            plan, seq.max_tokens, seq.ignore_eos, seq.num_prompt_tokens, config["max_model_len"], eos_ids
        )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_finish(workload):
    config, requests = workload
    sched = make_scheduler(**config)
    seqs_by_arrival, plans = build_workload(config, requests)
    pending = list(seqs_by_arrival)
    admitted: list[int] = []
    step = 0
    while pending or not sched.is_finished():
        if sched.is_finished() and pending:
            step = max(step, pending[0][0])
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        seqs, is_prefill = sched.schedule()
        check_step(sched, seqs, is_prefill)
        if is_prefill:
            admitted += [s.seq_id for s in seqs if s.seq_id not in admitted]
        tokens = [plans[s.seq_id][s.num_completion_tokens] for s in seqs]
        for seq in sched.postprocess(seqs, tokens):
            assert seq.status == FINISHED and seq.block_table == []
            assert seq not in sched.running and seq not in sched.waiting
        check_scheduler_invariants(sched)
        step += 1
        assert step < 5000, "the workload did not finish"

    assert admitted == sorted(admitted), "requests were admitted out of arrival order"
    check_workload_done(sched, config, seqs_by_arrival)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_resolved_one_step_late(workload):
    """As the engine drives the scheduler with async scheduling: each step is scheduled and
    advanced (placeholders) before the previous step's tokens are resolved. The completions are
    exactly those of the plans; tokens computed past an end are dropped; a step's inputs are
    placeholders only from the step right before it, at the recorded rows."""
    config, requests = workload
    sched = make_scheduler(**config)
    seqs_by_arrival, plans = build_workload(config, requests)
    pending = list(seqs_by_arrival)
    launched = None  # (seqs, positions) of the step in flight
    reported = []
    step = 0

    def resolve():
        seqs, positions = launched
        tokens = [plans[s.seq_id][p - s.num_prompt_tokens] if p >= 0 else -7 for s, p in zip(seqs, positions)]
        for seq in sched.resolve(seqs, positions, tokens):
            assert seq.is_complete and seq.block_table == [] and seq.num_pending == 0
            reported.append(seq.seq_id)

    while pending or not sched.is_finished() or launched:
        if sched.is_finished() and pending:
            step = max(step, pending[0][0])
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        seqs, is_prefill = sched.schedule()
        if not seqs:
            assert launched, "no progress although requests are pending"
            resolve()
            launched = None
            continue
        check_step(sched, seqs, is_prefill)
        previous = launched[0] if launched else []
        for seq in seqs:
            if seq.num_pending:  # its input comes from the step in flight, on the device
                assert not is_prefill and seq.num_pending == 1
                assert previous[seq.pending_row] is seq and seq.last_token == -1
        positions = sched.advance(seqs)
        if launched:
            resolve()
        launched = (seqs, positions)
        check_scheduler_invariants(sched)
        step += 1
        assert step < 5000, "the workload did not finish"

    assert sorted(reported) == sorted(plans) and len(set(reported)) == len(reported)
    check_workload_done(sched, config, seqs_by_arrival)
