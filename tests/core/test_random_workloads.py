"""Randomized workloads (hypothesis) driven through the Scheduler with fake sampled tokens:
the scheduler's and block manager's invariants hold after every step, and every request finishes
with the completion its plan implies, also when tokens are resolved one step late.
"""

import math

from core_helpers import (
    check_block_invariants,
    check_scheduler_invariants,
    make_scheduler,
    make_seq,
    run_step,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.engine.sequence import SequenceStatus

WAITING, RUNNING, FINISHED = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED


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
        (
            arrival,
            make_seq(prompt, block_size=config["block_size"], max_tokens=m, ignore_eos=ig),
            plan,
        )
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
            plan,
            seq.max_tokens,
            seq.ignore_eos,
            seq.num_prompt_tokens,
            config["max_model_len"],
            eos_ids,
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
        for seq in run_step(sched, seqs, tokens):
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
        tokens = [
            plans[s.seq_id][p - s.num_prompt_tokens] if p >= 0 else -7
            for s, p in zip(seqs, positions)
        ]
        for seq in sched.resolve(seqs, positions, tokens):
            assert seq.is_finished and seq.block_table == [] and seq.num_pending == 0
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
