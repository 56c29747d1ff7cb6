"""``add_lora`` (one cuBLAS shrink for every slot, then one Triton expand over rows grouped by
slot) against a float64 reference; the torch reference, the tile rule, input validation and the
benchmark's arguments. On the CPU, small cases under the Triton interpreter (this file run as a
script in a subprocess); on a CUDA GPU, real shapes in float32 and bf16 and CUDA graphs replayed
with new slots. Rows of no slot keep their bits."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_interpreter import results_under_interpreter, run_cases, squeeze_interpreter_loop_bounds

from nanovllm.lora.triton_ops import LoraTile, add_lora, add_lora_reference, launch_lora, lora_tile

I32 = torch.int32


def make_batch(num_tokens, k, n, rank, counts, dtype=torch.float32, device="cpu", x_view=None):
    """Random rows for each slot (the rest belong to none); the slots' ranges in ``order`` in
    reverse slot order with one unused entry after each. ``x_view``: "rows" (a row stride past
    K) or "cols" (every other column of a wider tensor)."""
    num_slots = len(counts)
    perm = torch.randperm(num_tokens).tolist()
    order, starts, taken = [], [0] * num_slots, 0
    for slot in reversed(range(num_slots)):
        starts[slot] = len(order)
        order += perm[taken : taken + counts[slot]] + [num_tokens]  # the gap: never read
        taken += counts[slot]
    order += [num_tokens] * (num_tokens + num_slots - len(order))  # one length for any counts
    w, t = torch.randn(2 * num_tokens, 2 * k + 5), num_tokens
    x = dict(rows=w[::2, 5 : k + 5], cols=w[:t, : 2 * k : 2]).get(x_view, w[:t, :k])
    a, b = torch.randn(num_slots, rank, k) * k**-0.5, torch.randn(num_slots, n, rank) * rank**-0.5
    batch = dict(y=torch.randn(num_tokens, n), x=x, lora_a=a, lora_b=b)
    batch = {name: t.to(dtype).to(device) for name, t in batch.items()}
    if x_view is None:
        batch["x"] = batch["x"].contiguous()
    index = dict(order=order, starts=starts, counts=counts)
    return batch | {name: torch.tensor(v, dtype=I32, device=device) for name, v in index.items()}


def reference_delta(batch) -> torch.Tensor:
    """What ``add_lora`` adds to y, in float64."""
    b = {name: t.double() if t.is_floating_point() else t for name, t in batch.items()}
    y = torch.zeros_like(b["y"])
    add_lora_reference(y, b["x"], b["lora_a"], b["lora_b"], b["order"], b["starts"], b["counts"])
    return y


def slot_rows(batch) -> torch.Tensor:
    """Whether each row belongs to a slot."""
    used = torch.zeros(batch["y"].shape[0], dtype=torch.bool, device=batch["y"].device)
    for start, count in zip(batch["starts"].tolist(), batch["counts"].tolist()):
        used[batch["order"][start : start + count].long()] = True
    return used


def check_add_lora(num_tokens, k, n, rank, counts, *, max_rows=None, tile=None, **kw) -> dict:
    """add_lora (or launch_lora with ``tile``) against the float64 reference: the norm-relative
    error of what was added, and whether rows of no slot kept their bits."""
    batch = make_batch(num_tokens, k, n, rank, counts, **kw)
    y0 = batch["y"].clone()
    max_rows = max(counts) if max_rows is None else max_rows
    if tile is None:
        add_lora(**batch, max_rows=max_rows)
    else:
        launch_lora(**batch, max_rows=max_rows, tile=tile)
    delta, ref = (batch["y"].double() - y0.double()), reference_delta(batch | {"y": y0})
    used = slot_rows(batch)
    return {
        "rel_err": ((delta - ref).norm() / ref.norm()).item() if ref.norm() > 0 else 0.0,
        "others_equal": torch.equal(batch["y"][~used], y0[~used]),
        "rows_used": int(used.sum()),
        "all_equal": torch.equal(batch["y"], y0),
    }


CPU_TOL = 1e-5  # float32 against float64
TILE_32 = LoraTile(32, 16, 16)  # N 40: three column programs; R 24: two rank steps
TILE_64 = LoraTile(64, 32, 32)
check, F16 = check_add_lora, torch.float16
INTERPRETER_CASES = {  # the rule's tile: 16-row blocks up to max_rows 64, 32 to 256, then 64
    "r24_uneven": lambda: check(20, 40, 56, 24, [7, 0, 9]),
    "r48_max_rows_past_counts": lambda: check(24, 64, 64, 48, [1, 12, 3, 5], max_rows=24),
    "r130_three_rank_steps": lambda: check(12, 40, 36, 130, [5, 0, 4], x_view="rows"),
    "r80_two_rank_steps_x_cols": lambda: check(16, 40, 24, 80, [5, 6, 3], x_view="cols"),
    "rank_8": lambda: check(9, 16, 24, 8, [3, 4]),
    "decode_one_row_each": lambda: check(6, 48, 32, 48, [1, 1, 0, 1]),
    "x_row_view": lambda: check(16, 40, 24, 24, [5, 6, 3], x_view="rows"),
    "x_col_view": lambda: check(16, 40, 24, 24, [5, 6, 3], x_view="cols"),
    "every_row_one_slot": lambda: check(12, 32, 20, 16, [12]),
    "rule_32_row_blocks": lambda: check(48, 24, 40, 12, [0, 40, 3], max_rows=200),
    "rule_64_row_blocks": lambda: check(80, 24, 72, 20, [70, 3], max_rows=300),
    "tile_32_rows": lambda: check(48, 24, 40, 24, [0, 40, 3], tile=TILE_32, x_view="cols"),
    "tile_64_rows_past_counts": lambda: check(24, 40, 24, 24, [11, 10], max_rows=150, tile=TILE_64),
    "all_counts_zero": lambda: check(16, 32, 32, 48, [0, 0, 0], max_rows=16),
    "all_counts_zero_64_rows": lambda: check(16, 32, 32, 48, [0, 0], max_rows=600),
    "all_counts_zero_max_rows_0": lambda: check(16, 32, 32, 48, [0, 0], max_rows=0),
    "fp16": lambda: check(20, 64, 48, 24, [6, 8, 4], dtype=F16),
    "fp16_tile_32": lambda: check(40, 40, 40, 24, [9, 2, 0, 25], dtype=F16, tile=TILE_32),
}
# no bf16 case: the interpreter's (3.9) tl.dot on bf16 inputs is wrong by orders of magnitude; the
# GPU tests cover bf16. fp16: u rounded to fp16 (2**-11) before the expand.
TOLERANCES = {"fp16": 2e-3, "fp16_tile_32": 2e-3}


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    torch.manual_seed(0)
    return run_cases(INTERPRETER_CASES)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_add_lora_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    assert "error" not in result, result["error"]
    if "counts_zero" in case:  # nothing added anywhere
        assert result["all_equal"] and result["rows_used"] == 0, result
    else:
        assert result["rel_err"] < TOLERANCES.get(case, CPU_TOL), result
        assert result["others_equal"] and result["rows_used"] > 0, result


def test_interpreter_cases_leave_base_rows():
    """The cases above keep some rows out of every slot (so the bitwise check means something)."""
    batch = make_batch(20, 8, 8, 4, [7, 0, 9])
    assert int(slot_rows(batch).sum()) == 16
    assert batch["order"].numel() >= 20 and batch["starts"].tolist() == [11, 10, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_matches_definition(dtype):
    """add_lora_reference against a row-by-row einsum over each row's own adapter."""
    torch.manual_seed(1)
    batch = make_batch(13, 12, 10, 6, [4, 0, 5], dtype=dtype)
    y = batch["y"].clone()
    add_lora_reference(**batch)
    slot_of = torch.full((13,), -1)
    for slot, (start, count) in enumerate(zip(batch["starts"].tolist(), batch["counts"].tolist())):
        slot_of[batch["order"][start : start + count].long()] = slot
    used = slot_of >= 0
    a, b = batch["lora_a"][slot_of[used]], batch["lora_b"][slot_of[used]]
    u = torch.einsum("tk,trk->tr", batch["x"][used], a)
    y[used] += torch.einsum("tr,tnr->tn", u, b)
    torch.testing.assert_close(batch["y"], y, rtol=1e-6, atol=1e-6)


def test_tile_rule():
    """16-row blocks up to 64 rows a slot, 32 up to 256, then 64 with 128 columns; the rank in
    steps of a power of two from 16 to 64."""
    assert lora_tile(1, 16) == LoraTile(16, 64, 16)
    assert lora_tile(64, 48) == LoraTile(16, 64, 64)
    assert lora_tile(65, 24) == LoraTile(32, 64, 32)
    assert lora_tile(256, 130) == LoraTile(32, 64, 64)
    assert lora_tile(257, 8) == LoraTile(64, 128, 16)
    assert lora_tile(8192, 192) == LoraTile(64, 128, 64)
    assert lora_tile(0, 1).block_m == 16
    assert [lora_tile(16, r).block_r for r in (1, 17, 33, 64, 65, 384)] == [16, 32, 64, 64, 64, 64]


DTYPES = "(torch.bfloat16, torch.float16, torch.float32)"
SHAPES = "y and x must be [T, N] and [T, K]"
CONTIGUOUS = "y's rows, lora_a and lora_b must be contiguous"
BAD_INPUTS = [
    ("y", torch.zeros(5, 6).double(), f"y.dtype must be one of {DTYPES}, got torch.float64"),
    ("y", torch.zeros(5, 6, 1), f"{SHAPES}, got shapes (5, 6, 1) and (5, 8)"),
    ("y", torch.zeros(5, 12)[:, ::2], CONTIGUOUS),
    ("x", torch.zeros(4, 8), f"{SHAPES}, got shapes (5, 6) and (4, 8)"),
    ("x", torch.zeros(5, 8).half(), "x.dtype must equal y.dtype (torch.float32), got torch.fl"),
    ("lora_a", torch.zeros(2, 4, 7), "lora_a must be [L, R, K=8], got (2, 4, 7)"),
    ("lora_a", torch.zeros(2, 8, 4).transpose(1, 2), CONTIGUOUS),
    ("lora_b", torch.zeros(2, 6, 5), "lora_b must be [L, N, R] = (2, 6, 4), got (2, 6, 5)"),
    ("lora_b", torch.zeros(6, 2, 4).transpose(0, 1), CONTIGUOUS),
    ("order", torch.zeros(5), "order must be a 1-D torch.int32 tensor, got torch.float32 1-D"),
    ("order", torch.zeros(4, dtype=I32), "order must have >= T = 5 elements, got 4"),
    ("counts", torch.zeros(3, dtype=I32), "and counts must have L = 2 elements, got 2 and 3"),
    ("max_rows", -1, "max_rows must be an int >= 0 (>= every count), got -1"),
    ("max_rows", 2.0, "max_rows must be an int >= 0 (>= every count), got 2.0"),
]


@pytest.mark.parametrize(
    "name,value,message", BAD_INPUTS, ids=[f"{i}-{case[0]}" for i, case in enumerate(BAD_INPUTS)]
)
def test_rejects_bad_inputs(name, value, message):
    args = make_batch(5, 8, 6, 4, [2, 1]) | {"max_rows": 2}
    error = TypeError if "dtype" in message or "int32" in message else ValueError
    with pytest.raises(error, match=re.escape(message)):
        add_lora(**args | {name: value})


BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "lora_kernels.py"


def test_benchmark_arguments_and_shapes():
    spec = importlib.util.spec_from_file_location("lora_kernels_bench", BENCHMARK)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(["--models", "8b", "--tokens", "1", "8192", "--rank", "8"])
    assert (args.models, args.tokens, args.rank, args.slots) == (["8b"], [1, 8192], 8, 4)
    assert bench.parse_args([]).tokens == [1, 16, 64, 256, 512, 8192]
    expected = {"qkv": (1024, 4096, 48), "o": (2048, 1024, 16), "gate_up": (1024, 6144, 32)}
    assert bench.projections("0.6b", 16) == expected | {"down": (3072, 1024, 16)}
    assert bench.even_counts(10, 4) == [3, 3, 2, 2] and bench.even_counts(1, 4) == [1, 0, 0, 0]
    with pytest.raises(SystemExit):
        bench.parse_args(["--rank", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_benchmark_exits_clearly_without_gpu():
    command = [sys.executable, str(BENCHMARK), "--tokens", "1"]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-1000:]


# ---- GPU: real shapes against the float64 reference ----------------------------------------------

gpu = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)
GPU_TOLS = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # IEEE float32; bf16 rounds u and y


def gpu_counts(num_tokens: int, num_slots: int = 4) -> list[int]:
    """Uneven counts over the slots, about an eighth of the rows left to the base model."""
    if num_tokens == 1:
        return [0, 1, 0, 0]
    w = torch.tensor([3.0, 1.0, 0.0, 2.0])[:num_slots]
    return (w / w.sum() * (num_tokens - num_tokens // 8)).floor().long().tolist()


GPU_SHAPES = {  # K, N, R: Qwen3-0.6B and -8B projections at rank 16 (qkv: 3 x 16 or 3 x 64)
    "0.6b_qkv": (1024, 4096, 48),
    "0.6b_o": (2048, 1024, 16),
    "8b_qkv_r64": (4096, 6144, 192),
    "8b_gate_up": (4096, 24576, 32),
    "8b_down": (12288, 4096, 16),
}


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_add_lora(dtype, shape):
    """Every block size of the rule (max_rows the row count, as in a graph, or the top count)."""
    (k, n, rank), dev = GPU_SHAPES[shape], "cuda"
    torch.manual_seed(k + n)
    for num_tokens in (1, 16, 64, 256, 512, 2048):
        counts = gpu_counts(num_tokens)
        for max_rows in (num_tokens, max(counts)):
            got = check(num_tokens, k, n, rank, counts, dtype=dtype, device=dev, max_rows=max_rows)
            assert got["rel_err"] < GPU_TOLS[dtype], (num_tokens, max_rows, got)
            assert got["others_equal"], (num_tokens, max_rows)
    for max_rows in (16, 256, 1024):  # 16-, 32- and 64-row blocks
        got = check(256, k, n, rank, [0] * 4, dtype=dtype, device=dev, max_rows=max_rows)
        assert got["all_equal"], max_rows


@gpu
@pytest.mark.parametrize("num_tokens", [64, 600], ids=["16_row_blocks", "64_row_blocks"])
def test_gpu_add_lora_cuda_graph(num_tokens):
    """Capture over static buffers, then replay with new rows, slot ranges and counts copied in."""
    torch.manual_seed(0)
    k, n, rank, bf16 = 1024, 2048, 48, torch.bfloat16
    scale = lambda counts: [c * num_tokens // 64 for c in counts]  # noqa: E731
    batch = make_batch(num_tokens, k, n, rank, scale([10, 0, 20, 5]), bf16, "cuda")
    add_lora(**batch, max_rows=num_tokens)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora(**batch, max_rows=num_tokens)
    for counts in map(scale, ([16, 16, 16, 16], [0, 0, 0, 0], [0, 64, 0, 0], [1, 2, 3, 50])):
        new = make_batch(num_tokens, k, n, rank, counts, bf16, "cuda")
        for name in ("y", "x", "order", "starts", "counts"):
            batch[name].copy_(new[name])
        graph.replay()
        new["lora_a"], new["lora_b"] = batch["lora_a"], batch["lora_b"]
        delta, ref = batch["y"].double() - new["y"].double(), reference_delta(new)
        if sum(counts):
            assert ((delta - ref).norm() / ref.norm()).item() < GPU_TOLS[bf16], counts
        assert torch.equal(batch["y"][~slot_rows(new)], new["y"][~slot_rows(new)]), counts


if __name__ == "__main__":
    print(json.dumps(run_interpreter_cases()))
