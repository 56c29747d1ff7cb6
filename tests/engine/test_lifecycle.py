"""An engine's life as a user meets it: calls after ``exit()``, a second engine beside a
tensor-parallel one, and a real Ctrl-C sent to the whole process group of a tensor- or data-parallel
engine (as a terminal does), after which the engine serves on with the same greedy tokens."""

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
from hf_reference import BLOCK_SIZE, random_prompts

from nanovllm import LLM, SamplingParams

CPU = dict(device="cpu", kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=64, max_model_len=256)


def test_calls_after_exit_are_clear_errors(ckpt_tied):
    llm = LLM(ckpt_tied.path, **CPU)
    prompt = random_prompts(5, [9])[0]
    llm.exit()
    calls = {
        "generate": lambda: llm.generate([prompt], use_tqdm=False),
        "stream": lambda: llm.stream([prompt]),
        "chat": lambda: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False),
        "step": llm.step,
        "add_request": lambda: llm.add_request(prompt, SamplingParams()),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="this LLM has exited"):
            call()
    assert llm.abort_request(0) is False
    stats = llm.get_stats()
    assert stats["num_requests_waiting"] == stats["num_requests_running"] == 0  # nothing was queued
    llm.exit()  # still idempotent


def test_second_engine_beside_a_tensor_parallel_one(ckpt_tied):
    """Refused with a clear error before anything starts; the first engine is untouched, and once
    it has exited a new one starts."""
    prompts = random_prompts(6, [12, 30])
    greedy = SamplingParams(temperature=0, max_tokens=8)
    first = LLM(ckpt_tied.path, tensor_parallel_size=2, **CPU)
    try:
        before = [o["token_ids"] for o in first.generate(prompts, greedy, use_tqdm=False)]
        for tp in (2, 1):
            with pytest.raises(RuntimeError, match="process group is already initialised"):
                LLM(ckpt_tied.path, tensor_parallel_size=tp, **CPU)
        assert [o["token_ids"] for o in first.generate(prompts, greedy, use_tqdm=False)] == before
    finally:
        first.exit()
    assert not multiprocessing.active_children()
    with LLM(ckpt_tied.path, tensor_parallel_size=2, **CPU) as second:
        assert [o["token_ids"] for o in second.generate(prompts, greedy, use_tqdm=False)] == before


CTRL_C_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    from nanovllm import LLM, SamplingParams

    if __name__ == "__main__":
        path, prompts, parallel = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
        greedy = SamplingParams(temperature=0, max_tokens=12)
        llm = LLM(path, device="cpu", kvcache_block_size=16, num_kvcache_blocks=256,
                  max_model_len=512, **parallel)
        before = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]

        def ctrl_c():  # as a terminal does: SIGINT to every process of the foreground group
            while llm.get_stats()["generation_tokens"] < 200:
                time.sleep(0.01)
            os.killpg(os.getpgid(0), signal.SIGINT)

        threading.Thread(target=ctrl_c, daemon=True).start()
        try:
            llm.generate([[1 + i, 2, 3] for i in range(64)],
                         SamplingParams(max_tokens=300, ignore_eos=True), use_tqdm=False)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        stats = llm.get_stats()
        after = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        llm.exit()
        print(json.dumps({"interrupted": interrupted, "before": before, "after": after,
                          "left": stats["num_requests_running"] + stats["num_requests_waiting"]}))
""")


@pytest.mark.parametrize(
    "parallel", [{"tensor_parallel_size": 2}, {"data_parallel_size": 2}], ids=["tp2", "dp2"]
)
def test_ctrl_c_to_the_process_group_of_a_parallel_engine(ckpt_tied, tmp_path, parallel):
    """Tensor-parallel workers, or data-parallel replicas: each process of the group gets the
    SIGINT."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT)
    prompts = random_prompts(7, [5, 40])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, str(script), ckpt_tied.path, json.dumps(prompts), json.dumps(parallel)],
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
        env=env,
    )  # its own group
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["interrupted"], "the SIGINT did not reach the generate call"
    assert result["left"] == 0, "the interrupted call left requests queued"
    assert result["after"] == result["before"]
