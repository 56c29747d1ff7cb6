"""The one-shot all-reduce (nanovllm/utils/custom_all_reduce.py) on two GPUs, one process each
(skipped with fewer): exactly the float32 sum of the ranks' tensors in rank order, rounded once to
the dtype, on every rank alike; over sizes that end inside a block, calls in a row (the epochs and
the two halves of the buffer), calls inside a CUDA graph replayed with new inputs, and an abort that
frees a call whose peer never comes. Then the engine with it: with two ranks a sum is one addition,
which NCCL rounds the same way, so its tokens and log-probabilities equal NCCL's exactly; and a
worker killed mid-call still ends in a clear error with both GPUs released."""
import faulthandler
import multiprocessing
import os
import signal
import threading
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

WORLD = 2
SIZES = [1, 7, 1024, 1025, 4096, 3 * 4096 + 5, 256 * 4096, 4 << 20]  # elements; the last is 8 MiB of bf16


def rank_input(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    return torch.randn(numel, generator=g, device="cuda").to(dtype)


def expected(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    total = torch.zeros(numel, device="cuda")
    for r in range(WORLD):
        total += rank_input(r, numel, dtype, seed).float()
    return total.to(dtype)


def _checks(rank: int) -> None:
    from nanovllm.utils import distributed

    assert distributed.enable_custom_all_reduce(torch.device("cuda", rank))
    custom = distributed._custom_all_reduce
    seed = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for numel in SIZES:
            if numel * dtype.itemsize > 8 << 20:
                continue
            for _ in range(3):  # calls in a row alternate halves of the buffer
                seed += 1
                x = rank_input(rank, numel, dtype, seed)
                assert custom.fits(x)
                custom(x)
                assert torch.equal(x, expected(numel, dtype, seed)), (dtype, numel)
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
    # an abort frees a call whose peer never comes (rank 1 stays away)
    torch.distributed.barrier()
    torch.cuda.synchronize()
    if rank == 0:
        threading.Timer(0.5, custom.abort).start()
        start = time.monotonic()
        custom(torch.ones(4096, device="cuda"))
        torch.cuda.synchronize()
        assert 0.4 < time.monotonic() - start < 10
    torch.distributed.barrier(device_ids=[rank])


def _worker(rank: int, port: int, errors) -> None:
    faulthandler.dump_traceback_later(240, exit=True)  # a rank that hangs shows where, and ends
    try:
        torch.cuda.set_device(rank)
        from nanovllm.utils.distributed import init_process_group

        init_process_group(torch.device("cuda", rank), rank, WORLD, port)
        _checks(rank)
        torch.distributed.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def test_gpu_custom_all_reduce_two_ranks():
    from nanovllm.engine.executor import _free_port as free_port

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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from nanovllm.utils.checkpoint import make_random_checkpoint

    return make_random_checkpoint(
        str(tmp_path_factory.mktemp("gpu-qwen3-ar")), "tiny", dtype=torch.bfloat16, seed=1, std=0.1,
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        num_hidden_layers=3, vocab_size=4096,
    )


def generate(model_dir, **kwargs):
    from nanovllm import LLM, SamplingParams

    prompts = [[(7 * i + j) % 4096 for j in range(n)] for i, n in enumerate((1, 30, 257, 700, 64, 5))]
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=2, max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=512,
             **kwargs) as llm:
        return [(o["token_ids"], o["logprobs"]) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_gpu_engine_custom_all_reduce_equals_nccl(model_dir, enforce_eager):
    want = generate(model_dir, enforce_eager=enforce_eager, disable_custom_all_reduce=True)
    got = generate(model_dir, enforce_eager=enforce_eager, disable_custom_all_reduce=False)
    assert got == want


def test_gpu_engine_custom_all_reduce_worker_killed(model_dir):
    """Rank 0 may be spinning in the one-shot kernel for the dead worker: the abort ends it."""
    from nanovllm import LLM, SamplingParams

    kwargs = dict(tensor_parallel_size=2, max_model_len=2048, disable_custom_all_reduce=False)
    llm = LLM(model_dir, **kwargs)
    worker = llm.core.executor.workers.processes[0]
    threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
        for _ in range(1000):
            llm.generate([[1, 2, 3] * 10] * 8, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.exit()
    assert not multiprocessing.active_children()
    with LLM(model_dir, **kwargs) as llm:
        assert len(llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]["token_ids"]) == 4
