"""Tensor parallelism on 2 CPU ranks (gloo): same greedy tokens as one rank and as transformers,
and the fault cases: a worker killed mid-generate or at start, clean exit, engines that do not
collide, and bad parallel sizes rejected before any process starts."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from hf_reference import BLOCK_SIZE, assert_greedy_match, mixed_prompts

from nanovllm import LLM, SamplingParams

MAX_TOKENS = 16


def make_llm(path: str, tp: int, **kwargs) -> LLM:
    # CPU ranks over gloo on every machine; NCCL on GPUs is covered by tests/gpu/test_gpu.py
    kwargs = (
        dict(device="cpu", kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=256, max_model_len=256)
        | kwargs
    )
    return LLM(path, tensor_parallel_size=tp, **kwargs)


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


def check_against_reference(outputs, prompts, path, hf_ref, what):
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert_greedy_match(
            out["token_ids"], hf_ref.greedy(path, prompt, MAX_TOKENS), f"{what}, prompt {i}"
        )


@pytest.mark.parametrize("ckpt_name", ["ckpt_tied", "ckpt_untied"])
def test_tp2_matches_tp1_and_transformers(ckpt_name, request, hf_ref):
    """Chunked prefill (64-token budget) with preemption (14 blocks); then, with a roomy cache,
    a second pass served from the prefix cache."""
    path = request.getfixturevalue(ckpt_name).path
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    results = {}
    for tp in (1, 2):
        with make_llm(path, tp, max_num_batched_tokens=64, num_kvcache_blocks=14) as llm:
            preempted = []
            preempt = llm.core.scheduler.preempt
            llm.core.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
            tight = llm.generate(prompts, params, use_tqdm=False)
        assert preempted, "14 blocks should force preemption"
        check_against_reference(tight, prompts, path, hf_ref, f"tp={tp}, chunked and preempted")
        with make_llm(path, tp) as llm:
            first = llm.generate(prompts, params, use_tqdm=False)
            again = llm.generate(prompts, params, use_tqdm=False)
        assert [o["num_cached_tokens"] for o in again] == [
            BLOCK_SIZE * ((len(p) - 1) // BLOCK_SIZE) for p in prompts
        ]
        check_against_reference(first, prompts, path, hf_ref, f"tp={tp}")
        check_against_reference(again, prompts, path, hf_ref, f"tp={tp}, prefix cached")
        results[tp] = [[o["token_ids"] for o in outs] for outs in (tight, first, again)]
    assert results[2] == results[1]


def test_tp4_replicates_the_two_kv_heads_and_matches_transformers(ckpt_tied, hf_ref):
    """4 ranks, 2 KV heads: ranks 0-1 hold KV head 0, ranks 2-3 head 1. Loaded, and drawn as dummy
    weights then reloaded from the folder (vLLM's reload example), greedy equals transformers."""
    prompts = mixed_prompts()[:6]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with make_llm(ckpt_tied.path, 4) as llm:
        check_against_reference(
            llm.generate(prompts, params, use_tqdm=False), prompts, ckpt_tied.path, hf_ref, "tp=4"
        )
    with make_llm(ckpt_tied.path, 4, load_format="dummy") as llm:
        llm.collective_rpc("update_config", args=({"load_config": {"load_format": "auto"}},))
        llm.collective_rpc("reload_weights")
        check_against_reference(
            llm.generate(prompts, params, use_tqdm=False),
            prompts,
            ckpt_tied.path,
            hf_ref,
            "tp=4, reloaded",
        )


def test_worker_killed_mid_generate(ckpt_tied):
    before = shm_entries()
    llm = make_llm(ckpt_tied.path, 2)
    worker = llm.core.executor.workers.processes[0]
    prompts = [[1, 2, 3] * 10] * 4
    threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
        for _ in range(1000):
            llm.generate(
                prompts,
                SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                use_tqdm=False,
            )
    assert time.monotonic() - start < 30
    with pytest.raises(RuntimeError, match="the engine has stopped"):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    llm.exit()
    assert not multiprocessing.active_children()
    assert shm_entries() <= before


def test_worker_killed_while_waiting_for_a_step(ckpt_tied):
    """A worker killed while it waits for a call: signalling it must not block, and the next call
    names it."""
    llm = make_llm(ckpt_tied.path, 2)
    worker = llm.core.executor.workers.processes[0]
    time.sleep(0.5)  # the idle worker waits on its event
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    errors = []

    def signal_dead_worker():
        try:
            llm.core.executor.channel.write("exit")
        except RuntimeError as e:
            errors.append(str(e))

    signal_it = threading.Thread(target=signal_dead_worker, daemon=True)
    signal_it.start()
    signal_it.join(10)
    assert not signal_it.is_alive(), "signalling the dead worker blocked"
    assert len(errors) == 1 and "worker rank 1" in errors[0], errors
    with pytest.raises(
        RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with code -9; the engine has stopped"
    ):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.exit()
    assert not multiprocessing.active_children()


def test_worker_dies_while_starting(ckpt_tied):
    """A worker that dies before the engine is up makes LLM() raise, not hang."""
    before = shm_entries()
    stop = threading.Event()

    def kill_first_child():
        while not stop.is_set():
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_first_child)
    killer.start()
    try:
        with pytest.raises(RuntimeError, match=r"worker rank 1 .* exited with code -9"):
            make_llm(ckpt_tied.path, 2)
    finally:
        stop.set()
        killer.join()
    assert not multiprocessing.active_children()
    assert shm_entries() <= before
    # the process is still fit to start an engine
    with make_llm(ckpt_tied.path, 2) as llm:
        assert (
            len(
                llm.generate(
                    [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
                )[0]["token_ids"]
            )
            == 3
        )


def test_exit_releases_everything_and_engines_follow_each_other(ckpt_tied):
    before = shm_entries()
    prompt = [[9, 8, 7, 6]]
    params = SamplingParams(temperature=0, max_tokens=5)
    outputs = []
    for _ in range(2):
        llm = make_llm(ckpt_tied.path, 2)
        assert len(shm_entries() - before) >= 1  # the control channel exists while it runs
        outputs.append(llm.generate(prompt, params, use_tqdm=False)[0]["token_ids"])
        llm.exit()
        llm.exit()  # idempotent
        assert not multiprocessing.active_children()
        assert shm_entries() <= before
    assert outputs[0] == outputs[1]


def test_exit_after_an_exception_inside_with(ckpt_tied):
    before = shm_entries()
    with pytest.raises(KeyError):
        with make_llm(ckpt_tied.path, 2):
            raise KeyError("user code failed")
    assert not multiprocessing.active_children()
    assert shm_entries() <= before


SCRIPT = """
import sys
from nanovllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, kvcache_block_size=16,
              num_kvcache_blocks=64, max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    print(llm.generate([[1, 2, 3, 4]], greedy, use_tqdm=False)[0]["token_ids"])
    # no exit(): interpreter exit must release the workers and the shared memory
"""


def test_two_processes_at_once_and_interpreter_exit(ckpt_tied, tmp_path):
    before = shm_entries()
    script = tmp_path / "engine.py"
    script.write_text(SCRIPT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), ckpt_tied.path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
    assert results[0][0] == results[1][0] and results[0][0].strip().startswith("[")
    assert shm_entries() <= before


def test_control_message_too_large_is_a_clear_error(ckpt_tied):
    with make_llm(ckpt_tied.path, 2) as llm:
        channel = llm.core.executor.channel
        with pytest.raises(ValueError, match="more than the .*-byte channel"):
            channel.write("run", list(range(channel.shm.size)))
        # nothing was sent: the engine keeps serving
        out = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(out[0]["token_ids"]) == 3


@pytest.mark.parametrize("tp,name", [(3, "num_attention_heads"), (8, "num_attention_heads")])
def test_bad_tensor_parallel_size_rejected_before_start(ckpt_tied, tp, name):
    with pytest.raises(
        ValueError, match=f"tensor_parallel_size={tp} must divide the model's {name}"
    ):
        make_llm(ckpt_tied.path, tp)
    assert not multiprocessing.active_children()


def test_one_all_reduce_per_attention_and_mlp_block(ckpt_tied, monkeypatch):
    """Rank 0 of a one-step generate: the embedding's all-reduce, then exactly one per attention
    block and one per MLP block (the logits are gathered, not reduced)."""
    calls = []
    real = torch.distributed.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    with make_llm(ckpt_tied.path, 2) as llm:
        monkeypatch.setattr(torch.distributed, "all_reduce", counting)
        llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        monkeypatch.undo()
        hf = llm.config.hf_config
    assert calls == [(5, hf.hidden_size)] * (1 + 2 * hf.num_hidden_layers)


def test_sampling_controls_match_one_rank(ckpt_tied):
    """Seeded top-k/top-p/min-p draws, penalties, logprobs, stop ids and strings, min_tokens and n
    on two ranks: only rank 0 samples, from logits gathered over the vocabulary slices, so every
    token, finish reason and log-probability equals the one-rank run's (float32; the ranks' partial
    sums differ only in rounding)."""
    prompts = mixed_prompts()[6:14]
    params = [
        SamplingParams(temperature=0.8, top_k=12, top_p=0.9, seed=1, max_tokens=12, logprobs=3),
        SamplingParams(
            temperature=0,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.3,
            max_tokens=12,
        ),
        SamplingParams(
            temperature=1.0,
            min_p=0.05,
            seed=2,
            max_tokens=12,
            min_tokens=4,
            stop_token_ids=[7, 9, 11],
        ),
        SamplingParams(temperature=0.7, seed=3, n=3, max_tokens=10, logprobs=0),
        SamplingParams(temperature=0.9, top_p=0.8, seed=4, max_tokens=12, stop=["a", "e"]),
        SamplingParams(
            temperature=0.6, top_k=20, top_p=0.95, seed=5, max_tokens=12, frequency_penalty=0.5
        ),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=1.2, seed=6, max_tokens=12),
    ]
    results = {}
    for tp in (1, 2):
        with make_llm(ckpt_tied.path, tp) as llm:
            results[tp] = llm.generate(prompts, params, use_tqdm=False)
    for i, (one, two) in enumerate(zip(results[1], results[2])):
        assert len(one["outputs"]) == len(two["outputs"]) == params[i].n
        for a, b in zip(one["outputs"], two["outputs"]):
            for key in ("token_ids", "text", "finish_reason", "stop_reason"):
                assert a[key] == b[key], (i, key, a[key], b[key])
            if a["logprobs"] is not None:
                for x, y in zip(a["logprobs"], b["logprobs"]):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t] - y[t]) < 1e-4 for t in x), (i, x, y)
    stopped = [o["stop_reason"] for o in results[1]]
    assert {type(r) for r in stopped} >= {int, str}, (
        f"the batch should end on a stop id and a stop string: {stopped}"
    )


def test_leaving_an_aborted_group_drops_the_one_shot_all_reduce():
    """After a rank died, ``abort_nccl`` has ended the default group before rank 0 leaves it; the
    one-shot all-reduce must go all the same, or the process's next engine would capture it into its
    decode graphs (``distributed.all_reduce``) while its new workers sum through NCCL."""
    from nanovllm.parallel import distributed, group
    from nanovllm.runner.multiproc_executor import _free_port

    try:
        group.init_process_group(torch.device("cpu"), 0, 1, _free_port())
        distributed._custom_all_reduce = object()  # stands for the kernel, which needs GPUs
        torch.distributed.distributed_c10d._abort_process_group()  # what abort_nccl does with NCCL
        assert not torch.distributed.is_initialized()
        group.leave_group()
        assert distributed._custom_all_reduce is None
        group.init_process_group(torch.device("cpu"), 0, 1, _free_port())  # a next group starts
        group.leave_group()
        assert not torch.distributed.is_initialized()
    finally:
        distributed._custom_all_reduce = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_symmetric_memory_is_seen(monkeypatch):
    """The one-shot all-reduce, on by default, maps its buffers with torch's symmetric memory: a
    torch that has it (this one) says so, one without it (its module cannot be imported) not."""
    from nanovllm.parallel import group

    assert group.has_symmetric_memory()
    monkeypatch.setitem(
        sys.modules, "torch.distributed._symmetric_memory", None
    )  # its import now fails
    assert not group.has_symmetric_memory()


def test_without_symmetric_memory_the_ranks_agree_on_nccl(monkeypatch):
    """``enable_custom_all_reduce`` on a group (one gloo rank here; the GPUs' peer check stubbed):
    without symmetric memory it sets nothing up, returns False and warns why."""
    from nanovllm.parallel import distributed, group
    from nanovllm.runner.multiproc_executor import _free_port

    monkeypatch.setattr(group, "_reaches_peers", lambda device, world: True)
    monkeypatch.setattr(group, "has_symmetric_memory", lambda: False)
    try:
        group.init_process_group(torch.device("cpu"), 0, 1, _free_port())
        with pytest.warns(
            UserWarning, match=r"torch .* has no symmetric memory\); NCCL sums everything"
        ):
            assert group.enable_custom_all_reduce(torch.device("cpu"), torch.bfloat16) is False
        assert distributed._custom_all_reduce is None and not group._set_up_before
    finally:
        group.leave_group()


ONE_RANK = """
import sys
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", kvcache_block_size=16, num_kvcache_blocks=64,
          max_model_len=128)
llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
llm.exit()
print(sorted(m for m in sys.modules if m.startswith("nanovllm.parallel")))
"""


def test_one_rank_loads_no_parallel_machinery(ckpt_tied):
    """At tensor_parallel_size=1 only the layers' rank/size/all-reduce helpers are loaded: no
    process group set-up, workers, control channel or one-shot all-reduce."""
    out = subprocess.run(
        [sys.executable, "-c", ONE_RANK, ckpt_tied.path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "['nanovllm.parallel', 'nanovllm.parallel.distributed']"


TWO_CTRL_C = """
import json, os, signal, sys, threading, time
from nanovllm import LLM, SamplingParams

def ctrl_c(llm, gap, start):  # as a terminal does: SIGINT to every process of the foreground group
    while llm.get_stats()["generation_tokens"] < start + 100:
        time.sleep(0.005)
    for _ in range(2):
        os.killpg(os.getpgid(0), signal.SIGINT)
        time.sleep(gap)

if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, kvcache_block_size=16,
              num_kvcache_blocks=256, max_model_len=512)
    prompts = [[1 + i, 2, 3] * 5 for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    before = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    result = {"interrupted": [], "after": []}
    for gap in (0.0, 0.01, 0.03, 0.1):
        long = SamplingParams(max_tokens=300, ignore_eos=True)
        start = llm.get_stats()["generation_tokens"]
        threading.Thread(target=ctrl_c, args=(llm, gap, start), daemon=True).start()
        try:
            llm.generate([[1 + i, 2, 3] for i in range(32)], long, use_tqdm=False)
            result["interrupted"].append(False)
        except KeyboardInterrupt:
            result["interrupted"].append(True)
        try:
            time.sleep(2 * gap + 0.2)  # a press that comes after the call has ended
        except KeyboardInterrupt:
            pass
        stats = llm.get_stats()
        assert stats["num_requests_running"] + stats["num_requests_waiting"] == 0, stats
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        result["after"].append([o["token_ids"] for o in outputs])
    llm.exit()
    print(json.dumps({"before": before, **result}))
"""


def test_two_ctrl_c_presses(ckpt_tied, tmp_path):
    """The second press comes while the first one's requests are being aborted: the ranks stay in
    step, the engine serves the same greedy tokens, and nothing is leaked at exit."""
    script = tmp_path / "two_ctrl_c.py"
    script.write_text(TWO_CTRL_C)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, str(script), ckpt_tied.path],
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(result["interrupted"]), "the SIGINT did not reach the generate call"
    assert result["after"] == [result["before"]] * len(result["after"])
