"""The norm that sums a row-parallel layer's partial outputs (nanovllm/parallel/reduce_norm.py)
under the Triton interpreter. The plain kernel (after the process group's sum) against
``layernorm.add_rms_norm``; the one-shot kernel, as one rank of a group whose peers are simulated
(their rows in their slots of this rank's buffer, the rest of it the sentinel), against the plain
kernel over the rank-order sum, bit for bit: the same arithmetic is what makes the two ways give the
same tokens. The engine's tensor-parallel tests run the CPU path (the process group's sum, then
``add_rms_norm``)."""

import json

import pytest
import torch
from triton_interpreter import (
    results_under_interpreter,
    round_interpreter_casts_to_nearest,
    run_cases,
)

EPS = 1e-6


def _rows(
    shape: tuple[int, int], dtype: torch.dtype, seed: int, scale: float = 1.0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def plain_case(rows: int, n: int, dtype: torch.dtype) -> dict:
    """``_add_rms_norm_kernel`` against ``add_rms_norm`` (torch): the sum + residual exactly (one
    rounding of the same addition), the norm within two units in the last place of ``dtype`` (its
    sum of squares is added in another order; the reciprocal root's last bit goes through two
    products)."""
    import triton

    from nanovllm.layers.layernorm import add_rms_norm
    from nanovllm.parallel.reduce_norm import _add_rms_norm_kernel

    x, res, w = _rows((rows, n), dtype, 1, 3.0), _rows((rows, n), dtype, 2), _rows((n,), dtype, 3)
    out, total = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel[(rows,)](x, res, w, out, total, EPS, N=n, N_PAD=triton.next_power_of_2(n))
    want_out, want_total = add_rms_norm(x, res, w, EPS)
    diff = (out.float() - want_out.float()).abs()
    ulp = want_out.float().abs().clamp_min(1e-30) * torch.finfo(dtype).eps
    return dict(
        total_equal=torch.equal(total, want_total),
        within_ulp=bool((diff <= 2 * ulp).all()),
        differing=int((diff > 0).sum()),
        count=out.numel(),
    )


def one_shot_case(
    world: int, rank: int, rows: int, n: int, dtype: torch.dtype, programs: int
) -> dict:
    """One call of the fused kernel with the peers' rows already in place (every other element of
    the buffers the sentinel): the pushed rows, the sentinel back where it read, and out / total
    equal to the plain kernel's over the float32 rank-order sum."""
    import triton

    from nanovllm.parallel.custom_all_reduce import TL_INT, sentinel
    from nanovllm.parallel.reduce_norm import _add_rms_norm_kernel, _one_shot_add_rms_norm_kernel

    inputs = [_rows((rows, n), dtype, 10 + r, 3.0) for r in range(world)]
    res, w = _rows((rows, n), dtype, 2), _rows((n,), dtype, 3)
    bits, value = sentinel(dtype)
    slot = rows * n + 7  # a slot holds the call's rows (and some to spare)
    data = [torch.full((2 * world * slot,), value, dtype=bits).view(dtype) for _ in range(world)]
    epochs = torch.zeros(programs, dtype=torch.int64)
    half = 1 * world * slot  # epoch 1: the odd half
    for r in range(world):
        if r != rank:
            data[rank][half + r * slot : half + r * slot + rows * n] = inputs[r].flatten()
    x = inputs[rank].clone()
    out, total = torch.empty_like(x), torch.empty_like(x)
    grid = min(rows, programs)
    _one_shot_add_rms_norm_kernel[(grid,)](
        x,
        res,
        w,
        out,
        total,
        rows,
        EPS,
        torch.tensor([d.data_ptr() for d in data]),
        epochs,
        torch.zeros(1, dtype=torch.int32),
        rank,
        slot,
        WORLD=world,
        COUNTERS=programs,
        N=n,
        N_PAD=triton.next_power_of_2(n),
        BITS=TL_INT[bits],
        SENTINEL=value,
        POLL=1 << 14,
    )
    summed = torch.zeros(rows, n)
    for t in inputs:
        summed += t.float()
    summed = summed.to(dtype)
    want_out, want_total = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel[(rows,)](
        summed, res, w, want_out, want_total, EPS, N=n, N_PAD=triton.next_power_of_2(n)
    )
    pushed = [
        torch.equal(
            data[r][half + rank * slot : half + rank * slot + rows * n], inputs[rank].flatten()
        )
        for r in range(world)
        if r != rank
    ]
    cleared = bool(
        (data[rank].view(bits) == value).all()
    )  # read slots put back, its own never written
    return dict(
        out_equal=torch.equal(out, want_out),
        total_equal=torch.equal(total, want_total),
        pushed=pushed,
        cleared=cleared,
        epochs=epochs.tolist(),
        grid=grid,
    )


CASES = {  # name: (world, rank, rows, hidden, dtype, most programs)
    "two_ranks_rank1_bf16": (2, 1, 5, 256, torch.bfloat16, 4),
    "two_ranks_rank0_one_row_each": (2, 0, 3, 200, torch.bfloat16, 4),
    "three_ranks_rank2_float32": (3, 2, 6, 128, torch.float32, 4),
}
PLAIN = {"plain_bf16": (7, 256, torch.bfloat16), "plain_float32_ragged": (3, 200, torch.float32)}


def run_interpreter_cases() -> dict:
    round_interpreter_casts_to_nearest()
    cases = {name: (lambda a=args: one_shot_case(*a)) for name, args in CASES.items()}
    cases |= {name: (lambda a=args: plain_case(*a)) for name, args in PLAIN.items()}
    return run_cases(cases)


@pytest.fixture(scope="module")
def results():
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("name", list(PLAIN))
def test_add_rms_norm_kernel_equals_torch(results, name):
    got = results[name]
    assert "error" not in got, got
    assert got["total_equal"]  # x + residual: one rounding of the same sum
    assert got["within_ulp"]
    if (
        PLAIN[name][2] == torch.bfloat16
    ):  # rounding to bfloat16 hides float32's last bits but rarely
        assert got["differing"] <= got["count"] // 20


@pytest.mark.parametrize("name", list(CASES))
def test_one_shot_add_rms_norm_equals_the_plain_kernel_over_the_sum(results, name):
    world, rank, rows, _, _, programs = CASES[name]
    got = results[name]
    assert "error" not in got, got
    assert got["out_equal"] and got["total_equal"]
    assert got["pushed"] == [True] * (
        world - 1
    )  # its rows into its slot of every other rank's buffer
    assert got["cleared"]
    assert got["grid"] == min(rows, programs)
    assert got["epochs"] == [1] * programs  # every counter counts the call


if __name__ == "__main__":
    print(json.dumps(run_interpreter_cases()))
