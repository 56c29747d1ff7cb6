"""Data parallelism on the CPU: two replica processes give the tokens one engine gives (greedy,
seeded, streamed; chunked prefill, n > 1, prefix hits), requests go to the replica with the fewest
outstanding tokens, an abort or an early break leaves every replica idle, a killed replica is a
clear error that leaves nothing behind, and bad values are refused before anything starts."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from dp_helpers import assert_idle, seeded_params, streamed, summary, workload
from hf_reference import BLOCK_SIZE, assert_greedy_match, random_prompts

from nanovllm import LLM, SamplingParams

CPU = dict(
    device="cpu",
    kvcache_block_size=BLOCK_SIZE,
    num_kvcache_blocks=64,
    max_model_len=256,
    max_num_batched_tokens=64,
)  # 64 tokens a step: the longer prompts are chunked


def shm_entries() -> set[str]:
    """/dev/shm's entries, less the control channels of engines in other processes still running
    (another test run on this host); a dead process's leftovers count."""
    ours = {os.getpid()} | {c.pid for c in multiprocessing.active_children()}

    def foreign(name: str) -> bool:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "nanovllm" or not parts[1].isdigit():
            return False
        pid = int(parts[1])
        return pid not in ours and os.path.exists(f"/proc/{pid}")

    return {name for name in os.listdir("/dev/shm") if not foreign(name)}


def children() -> set:
    """Child processes now (the module's engines' replicas among them)."""
    return set(multiprocessing.active_children())


@pytest.fixture(scope="module")
def engines(ckpt_tied):
    """One engine, and two replicas of it."""
    one = LLM(ckpt_tied.path, **CPU)
    two = LLM(ckpt_tied.path, data_parallel_size=2, **CPU)
    yield one, two
    one.exit()
    two.exit()
    assert not multiprocessing.active_children()


def test_greedy_tokens_equal_one_engine_and_transformers(engines, ckpt_tied, hf_ref):
    one, two = engines
    prompts, params = workload()
    first = [llm.generate(prompts, params, use_tqdm=False) for llm in engines]
    again = [
        llm.generate(prompts, params, use_tqdm=False) for llm in engines
    ]  # served from the prefix caches
    assert summary(first[1]) == summary(first[0])
    assert summary(again[1]) == summary(first[0])
    for i, (out, prompt) in enumerate(zip(first[1], prompts)):
        assert_greedy_match(
            out["token_ids"],
            hf_ref.greedy(ckpt_tied.path, prompt, params[i].max_tokens),
            f"prompt {i}",
        )
    # a request returns to the replica that served it: every full block but the last is a hit
    assert [o["num_cached_tokens"] for o in again[1]] == [
        BLOCK_SIZE * ((len(p) - 1) // BLOCK_SIZE) for p in prompts
    ]
    stats = two.get_stats()
    replicas = stats["replicas"]
    assert all(r["generation_tokens"] > 0 for r in replicas), "both replicas should have served"
    for key in ("generation_tokens", "prompt_tokens", "prefix_cache_hits", "prefix_cache_queries"):
        assert stats[key] == sum(r[key] for r in replicas)
    assert stats["generation_tokens"] == 2 * sum(
        sum(len(c["token_ids"]) for c in o["outputs"]) for o in first[1]
    )
    assert_idle(two)


def test_requests_go_to_the_replica_with_fewest_outstanding_tokens(engines):
    _, two = engines
    lengths, max_tokens, n = [10, 3, 3, 20, 4], [5, 5, 5, 5, 30], [1, 1, 1, 1, 2]
    ids = [
        two.add_request(random_prompts(i, [k])[0], SamplingParams(temperature=0, max_tokens=m, n=c))
        for i, (k, m, c) in enumerate(zip(lengths, max_tokens, n))
    ]
    # outstanding tokens (n × (prompt + max_tokens)): 15 → r0; [15, 0]: 8 → r1; [15, 8]: 8 → r1;
    # [15, 16]: 25 → r0; [40, 16]: 68 → r1
    assert [two.core.requests[i].replica for i in ids] == [0, 1, 1, 0, 1]
    assert two.core.load == [40, 84]
    finished = {}
    while not two.is_finished():
        outputs, _ = two.step()
        finished.update(outputs)
    assert sorted(finished) == sorted(
        ids + [ids[-1] + 1]
    )  # the n=2 request's second completion too
    assert [len(finished[i]) for i in ids] == max_tokens
    assert two.core.load == [0, 0] and not two.core.requests
    assert_idle(two)


def test_seeded_sampling_is_the_same_whatever_the_replica(engines):
    prompts = random_prompts(3, [5, 18, 33, 7])
    params = seeded_params(len(prompts))
    one, two = (summary(llm.generate(prompts, params, use_tqdm=False)) for llm in engines)
    assert two == one
    assert len({tuple(c[0]) for c in one[2][1]}) > 1, "the three seeded completions should differ"


def test_stream_concatenates_to_generate(engines):
    _, two = engines
    prompts, params = workload()
    assert streamed(two, prompts, params) == summary(two.generate(prompts, params, use_tqdm=False))
    assert_idle(two)


def test_abort_and_an_early_break_leave_every_replica_idle(engines):
    _, two = engines
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompts = random_prompts(4, [8, 9, 10, 11])
    for inc in two.stream(prompts, long):
        break
    assert_idle(two)
    ids = [two.add_request(p, long) for p in prompts]
    for _ in range(3):
        two.step()
    assert all(two.abort_request(i) for i in ids[1:])
    assert two.abort_request(ids[1]) is False  # already aborted
    finished = {}
    while not two.is_finished():
        outputs, _ = two.step()
        finished.update(outputs)
    assert list(finished) == [ids[0]] and len(finished[ids[0]]) == 200
    assert_idle(two)


def test_a_killed_replica_is_a_clear_error_and_leaves_nothing_behind(ckpt_tied):
    before, running = shm_entries(), children()
    llm = LLM(ckpt_tied.path, data_parallel_size=2, **CPU)
    victim = llm.core.replicas[1].process
    prompts = [[1 + i, 2, 3] * 10 for i in range(4)]
    threading.Timer(0.5, os.kill, (victim.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"data-parallel replica 1 \(pid \d+\) exited with code -9"
    ):
        for _ in range(1000):
            llm.generate(
                prompts,
                SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                use_tqdm=False,
            )
    assert time.monotonic() - start < 30
    assert children() == running  # the other replica has been stopped too
    with pytest.raises(RuntimeError, match="the engine has stopped"):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    llm.exit()
    assert shm_entries() <= before
    with LLM(
        ckpt_tied.path, data_parallel_size=2, **CPU
    ) as again:  # the process can start a new one
        out = again.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert [len(o["token_ids"]) for o in out] == [3] * 4
    assert children() == running


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(data_parallel_size=0), ValueError, r"Config.data_parallel_size must be >= 1, got 0"),
        (
            dict(data_parallel_size="two"),
            TypeError,
            r"Config.data_parallel_size must be an int, got 'two'",
        ),
        (dict(data_parallel_size=2.0), TypeError, r"Config.data_parallel_size must be an int"),
        (
            dict(data_parallel_backend="mpi"),
            ValueError,
            r"Config.data_parallel_backend must be one of 'mp', 'ray', got 'mpi'",
        ),
    ],
)
def test_bad_values_are_refused_before_anything_starts(ckpt_tied, kwargs, error, match):
    running = children()
    with pytest.raises(error, match=match):
        LLM(ckpt_tied.path, **CPU | kwargs)
    assert children() == running


def test_more_gpus_than_visible_is_refused_before_anything_starts(ckpt_tied, monkeypatch):
    """On a host with one GPU (the count is what torch reports), 2 replicas × 1 GPU do not fit."""
    running = children()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    kwargs = CPU | dict(device="cuda", attention_backend="torch", num_kvcache_blocks=-1)
    with pytest.raises(
        ValueError, match=r"data_parallel_size=2 × tensor_parallel_size=1 needs 2 GPUs, but only 1"
    ):
        LLM(ckpt_tied.path, data_parallel_size=2, **kwargs)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs, but only 1"):
        LLM(ckpt_tied.path, tensor_parallel_size=2, **kwargs)
    assert children() == running


def test_an_abort_leaves_the_counts_at_once(engines):
    """As with one engine, an aborted request is gone from ``get_stats`` at once, and a queued one
    is counted at once."""
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for llm in engines:
        ids = [llm.add_request(p, long) for p in random_prompts(5, [8, 9, 10, 11])]
        stats = llm.get_stats()
        assert stats["num_requests_running"] + stats["num_requests_waiting"] == 4
        llm.step()
        assert llm.abort_request(ids[0])
        stats = llm.get_stats()
        assert stats["num_requests_running"] + stats["num_requests_waiting"] == 3
        for i in ids[1:]:
            assert llm.abort_request(i)
        stats = llm.get_stats()
        assert stats["num_requests_running"] + stats["num_requests_waiting"] == 0
        while not llm.is_finished():
            llm.step()
        assert_idle(llm)


def run_script(script: str, tmp_path, *args) -> dict:
    """``script`` in a process group of its own (a Ctrl-C reaches all its processes); its last
    line of output, as JSON. Nothing may be reported leaked at its exit."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


KILLED_REPLICA = """
    import json, os, signal, sys
    from nanovllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], device="cpu", kvcache_block_size=16, num_kvcache_blocks=64,
                  max_model_len=128, data_parallel_size=2, tensor_parallel_size=2)
        prompts = [[1 + i, 2, 3] * 5 for i in range(4)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        pid = llm.core.replicas[1].process.pid
        left = lambda: sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"nanovllm-{pid}-"))
        channels = left()
        os.kill(pid, signal.SIGKILL)
        try:
            llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
            error = None
        except RuntimeError as e:
            error = str(e)
        print(json.dumps({"error": error, "channels": channels, "left": left()}))
        # no exit(): the interpreter's exit must find nothing leaked
"""


def test_a_killed_tensor_parallel_replica_leaves_no_shared_memory(ckpt_tied, tmp_path):
    result = run_script(KILLED_REPLICA, tmp_path, ckpt_tied.path)
    assert "data-parallel replica 1" in result["error"]
    assert len(result["channels"]) == 1, "the replica's control channel should have existed"
    assert result["left"] == [], "released when the death was found"


INTERRUPTED_RPC = """
    import json, os, signal, sys, threading, time
    from nanovllm import LLM, SamplingParams

    def mark(runner, value, seconds):
        time.sleep(seconds)
        runner.mark = value
        return value

    def read_mark(runner):
        return getattr(runner, "mark", None)

    def ctrl_c(*delays):  # as a terminal does: SIGINT to every process of the foreground group
        for delay in delays:
            time.sleep(delay)
            os.killpg(os.getpgid(0), signal.SIGINT)

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], device="cpu", kvcache_block_size=16, num_kvcache_blocks=64,
                  max_model_len=128, data_parallel_size=2)
        prompts = [[1 + i, 2, 3] * 5 for i in range(4)]
        greedy = SamplingParams(temperature=0, max_tokens=6)
        before = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        result = {"before": before, "interrupted": [], "marks": [], "after": []}
        for value, delays in ((1, [0.5]), (2, [0.5, 0.3])):  # one Ctrl-C, then two
            threading.Thread(target=ctrl_c, args=delays, daemon=True).start()
            try:
                llm.core.collective_rpc(mark, args=(value, 2.0))
                result["interrupted"].append(False)
            except KeyboardInterrupt:
                result["interrupted"].append(True)
            result["marks"].append(llm.core.collective_rpc(read_mark))
            result["after"].append([o["token_ids"] for o in llm.generate(prompts, greedy,
                                                                            use_tqdm=False)])
        llm.exit()
        print(json.dumps(result))
"""


def test_ctrl_c_during_a_call_to_every_replica(ckpt_tied, tmp_path):
    """Once or twice pressed while every replica runs a ``collective_rpc``: the call reaches every
    replica whole (all end on the same state), KeyboardInterrupt follows, and the engine serves
    the same greedy tokens."""
    result = run_script(INTERRUPTED_RPC, tmp_path, ckpt_tied.path)
    assert result["interrupted"] == [True, True]
    assert result["marks"] == [[1, 1], [2, 2]]
    assert result["after"] == [result["before"]] * 2
