"""The one-shot all-reduce kernel (nanovllm/utils/custom_all_reduce.py) under the Triton interpreter,
as one rank of a group whose peers are simulated: their inputs stand in their slots of this rank's
buffer, in the half that the call's epoch selects, and their signals in this rank's flags. The kernel
must write its input into its slot of every rank's buffer, sum the slots in rank order (every rank
the same float32 sum) over the blocks each program loops over, signal every rank's flags with the
epoch, count the calls, alternate halves, and give up a wait when the abort flag is set. The real
handshake between GPUs runs in tests/gpu/test_gpu_tensor_parallel.py."""
import json

import pytest
import torch

from triton_interpreter import results_under_interpreter, round_interpreter_casts_to_nearest, run_cases

BLOCKS = 5  # a slot of the buffer holds 5 blocks
PROGRAMS = 2  # the most programs of a call (the library allows more): one per block up to that


def simulate(world: int, rank: int, inputs: list[list[torch.Tensor]], dtype=torch.float32, abort: bool = False,
             peers_signal: bool = True) -> dict:
    """Run ``len(inputs)`` calls (each of one program per block, at most ``PROGRAMS``);
    ``inputs[k][r]`` is rank r's tensor in call k. Returns what the tests check, as lists."""
    from nanovllm.utils.custom_all_reduce import BLOCK, launch

    slot = BLOCKS * BLOCK
    data = [torch.zeros(2 * world * slot, dtype=dtype) for _ in range(world)]
    flags = [torch.zeros(PROGRAMS * world, dtype=torch.int64) for _ in range(world)]
    epochs = torch.zeros(PROGRAMS, dtype=torch.int64)
    abort_flag = torch.tensor([int(abort)], dtype=torch.int32)
    data_ptrs = torch.tensor([d.data_ptr() for d in data])
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags])
    out = {"sums": [], "pushed": [], "signals": [], "epochs": []}
    for k, call in enumerate(inputs, start=1):
        n = call[rank].numel()

        def slot_of(r: int) -> slice:  # rank r's slot in call k's half of a buffer
            start = ((k % 2) * world + r) * slot
            return slice(start, start + n)

        for r in range(world):
            if r != rank:
                data[rank][slot_of(r)] = call[r]
                if peers_signal:
                    flags[rank].view(PROGRAMS, world)[:, r] = k
        x = call[rank].clone()
        launch(x, data_ptrs, flag_ptrs, epochs, abort_flag, rank, world, slot)
        out["sums"].append(x.float().tolist())
        out["pushed"].append([torch.equal(data[r][slot_of(rank)], call[rank]) for r in range(world)])
        out["signals"].append([flags[r].view(PROGRAMS, world)[:, rank].tolist() for r in range(world)])
        out["epochs"].append(epochs.tolist())
    return out


def rank_order_sum(call: list[torch.Tensor]) -> list[float]:
    total = torch.zeros(call[0].numel())
    for t in call:
        total = total + t.float()
    return total.to(call[0].dtype).float().tolist()


def _inputs(world: int, sizes: list[int], dtype=torch.float32, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=g).to(dtype) for _ in range(world)] for n in sizes]


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
    """No peer ever signals, the abort flag is up: the call ends."""
    return simulate(2, 0, _inputs(2, [3000]), abort=True, peers_signal=False)


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
def test_one_shot_sums_and_signals(interpreter_results, name):
    world, rank, sizes, _ = CALLS[name]
    got = interpreter_results[name]
    assert "error" not in got, got
    assert got["sums"] == got["want"]  # exactly: the same float32 additions in rank order
    assert got["pushed"] == [[True] * world] * len(sizes)  # into its slot of every buffer, the epoch's half
    last_signal = [0] * PROGRAMS  # per program: the last call it ran in
    for k, n in enumerate(sizes, start=1):
        programs = min(PROGRAMS, -(-n // 1024))  # one per block of 1,024 elements
        last_signal[:programs] = [k] * programs
        assert got["epochs"][k - 1] == [k] * PROGRAMS  # every counter counts every call
        assert got["signals"][k - 1] == [last_signal] * world  # the call's programs signal every rank


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
