"""The one-shot all-reduce kernel (nanovllm/parallel/custom_all_reduce.py) under the Triton
interpreter, as one rank of a group whose peers are simulated: their inputs stand in their slots of
this rank's buffer, in the half that the call's epoch selects; every other element holds the
sentinel (-0.0's bits). The kernel must write its input (-0.0 as +0.0) into its slot of every other
rank's buffer, sum its own input and the peers' slots in rank order (every rank the same float32
sum) over the blocks each program loops over, put the sentinel back where it read, leave its own
slot alone, count the calls, alternate halves, and give up a wait when the abort flag is set. The
real exchange between GPUs runs in tests/gpu/test_gpu_tensor_parallel.py."""

import json

import pytest
import torch
from triton_interpreter import (
    results_under_interpreter,
    round_interpreter_casts_to_nearest,
    run_cases,
)

BLOCKS = 5  # a slot of the buffer holds 5 blocks
PROGRAMS = 2  # the most programs of a call (the library allows more): one per block up to that


def simulate(
    world: int,
    rank: int,
    inputs: list[list[torch.Tensor]],
    dtype=torch.float32,
    abort: bool = False,
    peers_write: bool = True,
    poll: int | None = None,
) -> dict:
    """Run ``len(inputs)`` calls (each of one program per block, at most ``PROGRAMS``);
    ``inputs[k][r]`` is rank r's tensor in call k; ``poll``: spins between reads of the abort flag
    (default the library's). Returns what the tests check, as lists."""
    from nanovllm.parallel.custom_all_reduce import BLOCK, POLL_ABORT_EVERY, launch, sentinel

    bits, value = sentinel(dtype)
    slot = BLOCKS * BLOCK
    data = [torch.full((2 * world * slot,), value, dtype=bits).view(dtype) for _ in range(world)]
    epochs = torch.zeros(PROGRAMS, dtype=torch.int64)
    abort_flag = torch.tensor([int(abort)], dtype=torch.int32)
    data_ptrs = torch.tensor([d.data_ptr() for d in data])
    out = {"sums": [], "pushed": [], "cleared": [], "own_slot_untouched": [], "epochs": []}
    for k, call in enumerate(inputs, start=1):
        n = call[rank].numel()

        def slot_of(r: int) -> slice:  # rank r's slot in call k's half of a buffer
            start = ((k % 2) * world + r) * slot
            return slice(start, start + n)

        for r in range(world):
            if r != rank and peers_write:
                data[rank][slot_of(r)] = canonical(call[r])
        x = call[rank].clone()
        launch(x, data_ptrs, epochs, abort_flag, rank, world, slot, poll or POLL_ABORT_EVERY)
        out["sums"].append(x.float().tolist())
        out["pushed"].append(
            [
                torch.equal(data[r][slot_of(rank)].view(bits), canonical(call[rank]).view(bits))
                for r in range(world)
                if r != rank
            ]
        )
        out["cleared"].append(
            [bool((data[rank][slot_of(r)].view(bits) == value).all()) for r in range(world)]
        )
        own = data[rank].view(bits).view(2, world, slot)[:, rank]  # its own slot, both halves
        out["own_slot_untouched"].append(bool((own == value).all()))
        out["epochs"].append(epochs.tolist())
    return out


def canonical(t: torch.Tensor) -> torch.Tensor:
    """t with -0.0 as +0.0, as a rank pushes it."""
    return torch.where(t == 0, torch.zeros_like(t), t)


def rank_order_sum(call: list[torch.Tensor]) -> list[float]:
    total = torch.zeros(call[0].numel())
    for t in call:
        total = total + t.float()
    return total.to(call[0].dtype).float().tolist()


def _inputs(
    world: int, sizes: list[int], dtype=torch.float32, seed: int = 0
) -> list[list[torch.Tensor]]:
    """Random tensors, every fifth element -0.0 (the sentinel's value) on every rank."""
    g = torch.Generator().manual_seed(seed)
    calls = [[torch.randn(n, generator=g).to(dtype) for _ in range(world)] for n in sizes]
    for call in calls:
        for t in call:
            t[::5] = -0.0
    return calls


CALLS = {  # name: (world, rank, sizes of the calls, dtype)
    "two_ranks_rank0": (2, 0, [2500, 1024, 7, 5 * 1024], torch.float32),
    "two_ranks_rank1": (2, 1, [4096, 1, 3000], torch.float32),
    "three_ranks_rank2": (3, 2, [1500, 1500], torch.float32),
    "bf16": (2, 1, [2049, 2049, 2049], torch.bfloat16),
}


def _case(name: str) -> dict:
    world, rank, sizes, dtype = CALLS[name]
    inputs = _inputs(world, sizes, dtype)
    got = simulate(world, rank, inputs, dtype)
    return got | {"want": [rank_order_sum(call) for call in inputs]}


def _rank_order_case() -> dict:
    """Three ranks hold 1e8, 1 and -1e8: summed in rank order that is (1e8 + 1) - 1e8 = 0 in
    float32; rank 2 summing its own value first would get 1."""
    values = [torch.full((5,), v) for v in (1e8, 1.0, -1e8)]
    return simulate(3, 2, [values])


def _abort_case() -> dict:
    """No peer ever writes, the abort flag is up: the call ends (the flag read every 64 spins, not
    the library's 16,384, which took the interpreter ~40 s)."""
    return simulate(2, 0, _inputs(2, [3000]), abort=True, peers_write=False, poll=64)


def run_interpreter_cases() -> dict:
    round_interpreter_casts_to_nearest()
    cases = {name: (lambda name=name: _case(name)) for name in CALLS}
    cases["rank_order"] = _rank_order_case
    cases["abort"] = _abort_case
    return run_cases(cases)


@pytest.fixture(scope="module")
def interpreter_results():
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("name", list(CALLS))
def test_one_shot_sums_pushes_and_clears(interpreter_results, name):
    world, rank, sizes, _ = CALLS[name]
    got = interpreter_results[name]
    assert "error" not in got, got
    assert got["sums"] == got["want"]  # exactly: the same float32 additions in rank order
    assert got["pushed"] == [[True] * (world - 1)] * len(
        sizes
    )  # into its slot of every other buffer, -0.0 as +0.0
    assert got["cleared"] == [[True] * world] * len(sizes)  # the sentinel back where it read
    assert got["own_slot_untouched"] == [True] * len(sizes)
    for k in range(1, len(sizes) + 1):
        assert got["epochs"][k - 1] == [k] * PROGRAMS  # every counter counts every call


def test_one_shot_sums_in_rank_order(interpreter_results):
    got = interpreter_results["rank_order"]
    assert "error" not in got, got
    assert got["sums"] == [[0.0] * 5]


def test_one_shot_abort_ends_the_wait(interpreter_results):
    got = interpreter_results["abort"]
    assert "error" not in got, got
    assert got["epochs"] == [[1] * PROGRAMS]


if __name__ == "__main__":
    print(json.dumps(run_interpreter_cases()))
