"""The one-shot all-reduce (nanovllm/parallel/custom_all_reduce.py) on two GPUs, one process each
(skipped with fewer): exactly the float32 sum of the ranks' tensors in rank order, rounded once to
the dtype, on every rank alike; in each dtype, over sizes that end inside a block, calls in a row
(the epochs and the two halves of the buffer), -0.0 among the inputs, every buffer back to the
sentinel after the calls, calls inside a CUDA graph replayed with new inputs, many small calls
with the ranks arriving at different times, and an abort that frees a call whose peer never comes.
Then tensor parallelism in the engine, with NCCL and with the one-shot kernel, the decode graphs'
sharded draw, a worker killed mid-call included (test_gpu.py's checkpoint, prompts and torch
reference)."""

import faulthandler
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import pytest
import test_gpu
import torch
import torch.multiprocessing as mp
from test_gpu import SMALL_BATCH, assert_agree, make_prompts, run

from nanovllm import LLM, SamplingParams

# test_gpu's module-scoped fixtures, found here by these names
model_dir, reference, hf_model = test_gpu.model_dir, test_gpu.reference, test_gpu.hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

WORLD = 2
STRESS_CALLS = 20_000
SIZES = [
    1,
    7,
    1024,
    1025,
    4096,
    3 * 4096 + 5,
    256 * 4096,
    4 << 20,
]  # elements; the last is 8 MiB of bf16


def rank_input(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    return torch.randn(numel, generator=g, device="cuda").to(dtype)


def expected(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    total = torch.zeros(numel, device="cuda")
    for r in range(WORLD):
        total += rank_input(r, numel, dtype, seed).float()
    return total.to(dtype)


def _all_sentinel(custom) -> bool:
    """Whether every element of the rank's buffer is back to the sentinel (no call in flight)."""
    from nanovllm.parallel.custom_all_reduce import sentinel

    bits, value = sentinel(custom.dtype)
    torch.distributed.barrier()
    torch.cuda.synchronize()
    return bool((custom.data.view(bits) == value).all())


def _checks(rank: int) -> None:
    from nanovllm.parallel import distributed
    from nanovllm.parallel import group as tp_group
    from nanovllm.parallel.custom_all_reduce import CustomAllReduce

    group = torch.distributed.group.WORLD.group_name
    seed = 0
    for dtype in (
        torch.float16,
        torch.float32,
    ):  # one kernel set-up per dtype (bf16: the engine's, below)
        custom = CustomAllReduce(torch.device("cuda", rank), rank, WORLD, group, dtype)
        assert not custom.fits(
            torch.zeros(4, dtype=torch.bfloat16, device="cuda")
        )  # another dtype: NCCL
        for numel in SIZES:
            if numel * dtype.itemsize > 8 << 20:
                continue
            for _ in range(3):  # calls in a row alternate halves of the buffer
                seed += 1
                x = rank_input(rank, numel, dtype, seed)
                assert custom.fits(x)
                custom(x)
                assert torch.equal(x, expected(numel, dtype, seed)), (dtype, numel)
        assert _all_sentinel(custom)  # every element read was put back, every push read
    assert tp_group.enable_custom_all_reduce(torch.device("cuda", rank), torch.bfloat16)
    custom = distributed._custom_all_reduce
    for numel in SIZES:
        for _ in range(3):
            seed += 1
            x = rank_input(rank, numel, torch.bfloat16, seed)
            x[::3] = -0.0  # the sentinel's value: pushed as +0.0
            custom(x)
            want = expected(numel, torch.bfloat16, seed)
            want[::3] = 0.0
            assert torch.equal(x, want), numel
    assert _all_sentinel(custom)
    # larger than the buffer: NCCL
    assert not custom.fits(torch.empty(4 << 20, dtype=torch.float32, device="cuda"))
    # a CUDA graph of three calls, replayed with new inputs
    sizes = [4096, 64 * 4096, 5]
    static = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for x in static:
            custom(x)
    for _ in range(4):
        seed += 1
        for i, x in enumerate(static):
            x.copy_(rank_input(rank, x.numel(), x.dtype, seed + 1000 * i))
        graph.replay()
        for i, x in enumerate(static):
            assert torch.equal(x, expected(x.numel(), x.dtype, seed + 1000 * i)), ("graph", i)
    # many small calls in a row, the ranks arriving at different times (a few matmuls of their own
    # first): every sum is right and every program counted every call (a warp that read its
    # program's count after another had advanced it waited for an epoch that never came)
    counts = custom.epochs.clone()
    x = torch.empty(16 * 4096, dtype=torch.bfloat16, device="cuda")
    wrong = torch.zeros((), dtype=torch.int64, device="cuda")
    a, out = torch.randn(1024, 1024, device="cuda"), torch.empty(1024, 1024, device="cuda")
    delays = torch.randint(
        0, 3, (STRESS_CALLS,), generator=torch.Generator().manual_seed(rank)
    ).tolist()
    for i, delay in enumerate(delays):
        for _ in range(delay):
            torch.mm(a, a, out=out)
        x.fill_((rank + 1) * (i % 7 + 1))
        custom(x)
        wrong += (x != 3 * (i % 7 + 1)).sum()
    assert wrong.item() == 0
    assert torch.equal(custom.epochs, counts + STRESS_CALLS)
    assert _all_sentinel(custom)
    # an abort frees a call whose peer never comes (rank 1 stays away)
    torch.distributed.barrier()
    torch.cuda.synchronize()
    if rank == 0:
        threading.Timer(0.5, custom.abort).start()
        start = time.monotonic()
        custom(torch.ones(4096, dtype=torch.bfloat16, device="cuda"))
        torch.cuda.synchronize()
        assert 0.4 < time.monotonic() - start < 10
    torch.distributed.barrier(device_ids=[rank])


def _worker(rank: int, port: int, errors) -> None:
    faulthandler.dump_traceback_later(240, exit=True)  # a rank that hangs shows where, and ends
    try:
        torch.cuda.set_device(rank)
        from nanovllm.parallel.group import init_process_group

        init_process_group(torch.device("cuda", rank), rank, WORLD, port)
        _checks(rank)
        torch.distributed.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def test_gpu_custom_all_reduce_two_ranks():
    from nanovllm.runner.multiproc_executor import _free_port as free_port

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, errors)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    messages = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert all(p.exitcode == 0 for p in procs), "\n".join(messages) or [p.exitcode for p in procs]


# ---- tensor parallelism in the engine ----------------------------------------------------------


def test_tp2_matches_tp1(model_dir):
    """NCCL tensor parallelism over two GPUs, with prefix-cache hits and chunked prefill, in float32
    with torch attention: the same tokens as one GPU. (Two ranks sum a row-parallel layer's partial
    products in another order; in float32 that moves the logits by float32 rounding (2^-24
    relative per operation), orders of magnitude below any top-2 gap here, while in bf16 it can flip
    a near-tie.)"""
    prompts = make_prompts()
    kwargs = dict(
        dtype="float32",
        attention_backend="torch",
        kvcache_block_size=256,
        max_num_batched_tokens=512,
    )
    want, _ = run(model_dir, prompts, **kwargs)
    got, again = run(model_dir, prompts, tensor_parallel_size=2, **kwargs)
    assert got == want
    assert again == got


def test_tp2_graphs_match_torch_reference(model_dir, reference, hf_model):
    """bf16 with CUDA graphs (the all-reduce captured inside them) and the default backend agrees
    with the one-GPU torch reference, near-ties aside."""
    prompts = make_prompts()
    got, again = run(
        model_dir,
        prompts,
        tensor_parallel_size=2,
        kvcache_block_size=256,
        max_num_batched_tokens=512,
    )
    assert_agree(hf_model, prompts, reference, got)
    assert_agree(hf_model, prompts, got, again)


def _seeded_tokens(model_dir, logprobs: int | None) -> list[list[int]]:
    prompts = make_prompts()
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True, logprobs=logprobs)
        for i in range(len(prompts))
    ]
    with LLM(
        model_dir,
        tensor_parallel_size=2,
        max_model_len=2048,
        max_num_batched_tokens=512,
        **SMALL_BATCH,
    ) as llm:
        return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_tp2_draw_in_graphs_equals_draw_on_rank0(model_dir):
    """A plain seeded draw runs inside the decode graphs, each rank over its share of the
    vocabulary, the ranks exchanging each row's winners; asking for log-probabilities makes the
    steps gather the logits on rank 0 and draw there. The same logits and the same noise per token
    id (each engine from scratch): the same tokens."""
    in_graphs = _seeded_tokens(model_dir, None)
    assert in_graphs == _seeded_tokens(model_dir, 0)
    assert len({tuple(t) for t in in_graphs}) == len(in_graphs)


def in_fresh_process(fn, *args):
    """Run ``fn(*args)`` (a function of this module; arguments and result plain JSON data) in a new
    interpreter, as rank 0 of the engines it starts, and return its result: torch sets the one-shot
    all-reduce up once per process, so every engine that is to use it starts from one. The process
    is a plain ``python``, as a user's script (a hang dumps its stacks at 170 s and ends)."""
    code = (
        "import faulthandler, json, sys; faulthandler.dump_traceback_later(170, exit=True); "
        "sys.path.insert(0, sys.argv[1]); import test_gpu_tensor_parallel as t; "
        "print('RESULT ' + json.dumps(getattr(t, sys.argv[2])(*json.loads(sys.argv[3]))))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(Path(__file__).parent), fn.__name__, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # rank 0 and its workers
        out, err = proc.communicate()
        raise AssertionError(f"no result in 200 s:\n{err[-4000:]}") from None
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.split("RESULT ", 1)[1])


def _tp2_outputs(model_dir, enforce_eager: bool, nccl_only: bool) -> list:
    from nanovllm.parallel import distributed

    prompts = make_prompts()
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    with LLM(
        model_dir,
        tensor_parallel_size=2,
        max_model_len=2048,
        max_num_batched_tokens=512,
        enforce_eager=enforce_eager,
        disable_custom_all_reduce=nccl_only,
        **SMALL_BATCH,
    ) as llm:
        assert (distributed._custom_all_reduce is None) == nccl_only
        outputs = [
            (o["token_ids"], o["logprobs"]) for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        if not nccl_only:  # the decode graphs summed with it (its set-up made one call)
            assert distributed._custom_all_reduce.epochs[0].item() > 1
        return outputs


def test_tp2_one_shot_all_reduce_equals_nccl(model_dir):
    """With two ranks every sum is one addition, which NCCL and the one-shot kernel (the decode
    graphs' sums) round alike: the same tokens and log-probabilities, bit for bit, in bf16."""
    want = json.loads(
        json.dumps(_tp2_outputs(model_dir, False, nccl_only=True))
    )  # as the other process reports it
    assert in_fresh_process(_tp2_outputs, model_dir, False, False) == want


def _kill_a_worker(model_dir, enforce_eager: bool, nccl_only: bool) -> None:
    kwargs = dict(
        tensor_parallel_size=2,
        max_model_len=2048,
        kvcache_block_size=256,
        enforce_eager=enforce_eager,
        disable_custom_all_reduce=nccl_only,
    )
    llm = LLM(model_dir, **kwargs)
    worker = llm.core.executor.workers.processes[0]
    threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
        for _ in range(1000):
            llm.generate(
                [[1, 2, 3] * 10] * 8,
                SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
                use_tqdm=False,
            )
    assert time.monotonic() - start < 30
    llm.exit()
    assert not multiprocessing.active_children()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with LLM(model_dir, **kwargs) as llm:
            assert (
                len(
                    llm.generate(
                        [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
                    )[0]["token_ids"]
                )
                == 4
            )
    # a second engine of this process sums with NCCL, and says so
    said = any("set it up for an earlier engine" in str(w.message) for w in caught)
    assert said == (not nccl_only)


@pytest.mark.parametrize(
    "enforce_eager, nccl_only",
    [(True, True), (False, True), (False, False)],
    ids=["eager", "graphs", "graphs-one-shot-all-reduce"],
)
def test_tp2_worker_killed_mid_generate(model_dir, enforce_eager, nccl_only):
    """With NCCL, rank 0 may be waiting on a collective that the dead worker will never join (also
    inside a CUDA graph), or spinning in the one-shot all-reduce for it: the engine must raise,
    release both GPUs and let a new engine start."""
    if nccl_only:
        _kill_a_worker(model_dir, enforce_eager, nccl_only)
    else:
        in_fresh_process(_kill_a_worker, model_dir, enforce_eager, nccl_only)
