"""``lora_linear`` (one cuBLAS GEMM over a layer's weight and every slot's A, then one Triton
kernel adding each row's own slot, over rows grouped in blocks by ``block_table``) against a
float64 reference; the block table's exact values, the tile rule, input validation and the
benchmark's arguments. On the CPU, small cases under the Triton interpreter (this file run as a
script in a subprocess); on a CUDA GPU, real shapes in float32 and bf16 and CUDA graphs replayed
with new rows."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from triton_interpreter import results_under_interpreter, run_cases, squeeze_interpreter_loop_bounds

from nanovllm.lora.blocks import block_table, capture_table, max_blocks
from nanovllm.lora.triton_ops import (
    LoraTile,
    launch_lora,
    lora_linear,
    lora_linear_reference,
    lora_tile,
)

I32 = torch.int32


def random_slots(num_rows: int, num_slots: int, used: int, base_share: float = 0.25) -> np.ndarray:
    """Each of the first ``used`` rows gets a slot or -1 (about ``base_share`` of them)."""
    rng = np.random.default_rng(num_rows * 31 + num_slots)
    slots = rng.integers(0, num_slots, used)
    slots[rng.random(used) < base_share] = -1
    return slots


def make_case(num_rows, k, n, width, slots, num_slots, dtype=torch.float32, device="cpu", **kw):
    """Inputs of ``lora_linear``; ``bias``: with a bias; ``x_view``: rows with a stride past K."""
    x = torch.randn(num_rows, k + 3)[:, :k] if kw.get("x_view") else torch.randn(num_rows, k)
    ext = torch.randn(n + num_slots * width, k) * k**-0.5
    b = torch.randn(num_slots, n, width) * width**-0.5
    bias = torch.randn(n) if kw.get("bias") else None
    blocks, order = block_table(slots, num_rows, num_slots)
    capacity = 1 + 3 * max_blocks(num_rows, num_slots, 16)
    padded = np.zeros(capacity, dtype=np.int32)
    padded[: len(blocks)] = blocks
    to = lambda t: None if t is None else t.to(dtype).to(device)  # noqa: E731
    case = dict(x=to(x), ext=to(ext), lora_b=to(b), bias=to(bias))
    case["blocks"] = torch.from_numpy(padded).to(device)
    case["order"] = torch.from_numpy(order).to(device)
    return case


def row_slots(slots: np.ndarray, num_rows: int) -> torch.Tensor:
    out = torch.full((num_rows,), -1)
    out[: len(slots)] = torch.from_numpy(slots)
    return out


def check_lora_linear(num_rows, k, n, width, num_slots, used=None, *, tile=None, **kw) -> dict:
    """``lora_linear`` against the float64 reference: norm-relative error over all rows and over
    the rows of no slot (padding rows included)."""
    slots = random_slots(num_rows, num_slots, num_rows if used is None else used)
    case = make_case(num_rows, k, n, width, slots, num_slots, **kw)
    out = lora_linear(**case) if tile is None else launch_lora(**case, tile=tile)
    as64 = {name: None if t is None else t.double() for name, t in case.items()}  # on its device
    per_row = row_slots(slots, num_rows).to(out.device)
    ref = lora_linear_reference(as64["x"], as64["ext"], as64["lora_b"], as64["bias"], per_row)
    err = lambda a, b: ((a - b).norm() / b.norm()).item() if b.norm() > 0 else 0.0  # noqa: E731
    base = per_row < 0
    return {
        "rel_err": err(out.double(), ref),
        "base_err": err(out.double()[base], ref[base]),
        "rows_with_slot": int((~base).sum()),
    }


def check_capture_table(num_rows: int, max_rows: int) -> dict:
    """A graph's capture at ``num_rows`` with the table of ``max_rows``: every row gets the base
    output (plus bias), none past ``num_rows`` is touched."""
    case = make_case(num_rows, 24, 40, 16, np.full(num_rows, -1), 3, bias=True)
    blocks, order = capture_table(max_rows)
    padded = np.zeros(max(len(blocks), len(case["blocks"])), dtype=np.int32)
    padded[: len(blocks)] = blocks
    case["blocks"], case["order"] = torch.from_numpy(padded), torch.from_numpy(order)
    out = lora_linear(**case)
    ref = case["x"].double() @ case["ext"][:40].double().T + case["bias"].double()
    return {"rel_err": ((out.double() - ref).norm() / ref.norm()).item(), "base_err": 0.0,
            "rows_with_slot": 1}  # fmt: skip


CPU_TOL = 1e-5  # float32 against float64
check, F16 = check_lora_linear, torch.float16
INTERPRETER_CASES = {  # 16-row blocks up to 512 rows, then 64
    "width24_three_slots": lambda: check(20, 40, 56, 24, 3),
    "width48_four_slots_bias": lambda: check(24, 64, 64, 48, 4, bias=True),
    "width130_three_rank_steps": lambda: check(12, 40, 36, 130, 3, x_view=True),
    "width8": lambda: check(9, 16, 24, 8, 2),
    "padding_rows_past_slots": lambda: check(32, 48, 32, 48, 4, used=19),
    "one_slot_many_blocks": lambda: check(40, 32, 20, 16, 1, bias=True),
    "64_row_blocks": lambda: check(600, 24, 72, 20, 2, used=590),
    "tile_32x16x16": lambda: check(48, 24, 40, 24, 3, tile=LoraTile(32, 16, 16)),
    "fp16": lambda: check(20, 64, 48, 24, 3, dtype=F16, bias=True),
    "capture_table_20_of_70_rows": lambda: check_capture_table(20, 70),
    "capture_table_all_rows": lambda: check_capture_table(33, 33),
}
# no bf16 case: the interpreter's (3.9) tl.dot on bf16 inputs is wrong by orders of magnitude; the
# GPU tests cover bf16. fp16: z rounded to fp16 (2**-11) before the kernel.
TOLERANCES = {"fp16": 2e-3}


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    torch.manual_seed(0)
    return run_cases(INTERPRETER_CASES)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_lora_linear_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    assert "error" not in result, result["error"]
    tol = TOLERANCES.get(case, CPU_TOL)
    assert result["rel_err"] < tol and result["base_err"] < tol, result
    assert result["rows_with_slot"] > 0, result


def test_block_table_exact():
    """Rows grouped by slot (no slot and padding last), blocks of at most 16 rows."""
    blocks, order = block_table(np.array([1, -1, 0, 1, 1]), 7, 2)
    assert order.tolist() == [2, 0, 3, 4, 1, 5, 6]
    assert blocks.tolist() == [3, 0, 0, 1, 1, 1, 3, -1, 4, 3]
    slots = np.array([0] * 40 + [-1] * 3)
    blocks, order = block_table(slots, 43, 3)
    assert order.tolist() == list(range(43))
    assert blocks.tolist() == [4, 0, 0, 16, 0, 16, 16, 0, 32, 8, -1, 40, 3]
    blocks, _ = block_table(np.full(600, 1), 600, 2)  # 64-row blocks above 512 rows
    assert blocks.tolist() == [10, *[v for i in range(9) for v in (1, 64 * i, 64)], 1, 576, 24]
    for num_rows, num_slots in ((1, 4), (17, 1), (512, 4), (513, 8), (8192, 4)):
        slots = random_slots(num_rows, num_slots, num_rows)
        blocks, _ = block_table(slots, num_rows, num_slots)
        assert blocks[0] <= max_blocks(num_rows, num_slots, 16 if num_rows <= 512 else 64)


def test_capture_table_exact():
    blocks, order = capture_table(40)
    assert blocks.tolist() == [3, -1, 0, 16, -1, 16, 16, -1, 32, 16]
    assert order.tolist() == list(range(40))


def test_reference_matches_definition():
    """lora_linear_reference against a row-by-row einsum over each row's own adapter."""
    torch.manual_seed(1)
    slots = np.array([0, -1, 2, 2, 1, -1, 0])
    case = make_case(7, 12, 10, 6, slots, 3, dtype=torch.float64, bias=True)
    got = lora_linear_reference(
        case["x"], case["ext"], case["lora_b"], case["bias"], row_slots(slots, 7)
    )
    n, width = 10, 6
    want = case["x"] @ case["ext"][:n].T + case["bias"]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            a = case["ext"][n + s * width : n + (s + 1) * width]
            want[t] += (a @ case["x"][t]) @ case["lora_b"][s].T
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_tile_rule():
    """16-row blocks of 64 columns up to 512 rows, then 64 x 128; the rank in steps of a power
    of two from 16 to 64."""
    assert lora_tile(1, 16) == LoraTile(16, 64, 16)
    assert lora_tile(512, 48) == LoraTile(16, 64, 64)
    assert lora_tile(513, 8) == LoraTile(64, 128, 16)
    assert [lora_tile(16, r).block_r for r in (1, 17, 33, 64, 65, 384)] == [16, 32, 64, 64, 64, 64]


DTYPES = "(torch.bfloat16, torch.float16, torch.float32)"
SHAPES = "x and ext must be [T, K] and [N + L*W, K]"
CONTIGUOUS = "x's rows, ext and lora_b must be contiguous"
BAD_INPUTS = [
    ("x", torch.zeros(5, 8).double(), f"x.dtype must be one of {DTYPES}, got torch.float64"),
    ("x", torch.zeros(5, 8, 1), f"{SHAPES}, got (5, 8, 1) and (14, 8)"),
    ("x", torch.zeros(8, 5).t(), CONTIGUOUS),
    ("ext", torch.zeros(14, 7), f"{SHAPES}, got (5, 8) and (14, 7)"),
    (
        "ext",
        torch.zeros(14, 8).half(),
        "ext.dtype must equal x.dtype (torch.float32), got torch.fl",
    ),
    ("ext", torch.zeros(8, 14).t(), CONTIGUOUS),
    (
        "lora_b",
        torch.zeros(2, 6, 5),
        "lora_b must be [L, N, W] with N + L*W = 14 (ext's rows), got",
    ),
    ("lora_b", torch.zeros(6, 2, 4).transpose(0, 1), CONTIGUOUS),
    ("bias", torch.zeros(5), "bias must be [N=6], got (5,)"),
    ("blocks", torch.zeros(40), "blocks must be a 1-D torch.int32 tensor, got torch.float32 1-D"),
    ("blocks", torch.zeros(3, dtype=I32), "blocks must have >= 13 elements for T = 5, got 3"),
    ("order", torch.zeros(4, dtype=I32), "order must have >= T = 5 elements, got 4"),
]


@pytest.mark.parametrize(
    "name,value,message", BAD_INPUTS, ids=[f"{i}-{case[0]}" for i, case in enumerate(BAD_INPUTS)]
)
def test_rejects_bad_inputs(name, value, message):
    args = make_case(5, 8, 6, 4, np.array([0, 1, -1]), 2, bias=True)
    error = TypeError if "dtype" in message or "int32" in message else ValueError
    with pytest.raises(error, match=re.escape(message)):
        lora_linear(**args | {name: value})


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
GPU_TOLS = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # IEEE float32; bf16 rounds z and out

GPU_SHAPES = {  # K, N, W: Qwen3-0.6B and -8B projections at rank 16 (qkv: 3 x 16 or 3 x 64)
    "0.6b_qkv": (1024, 4096, 48),
    "0.6b_o": (2048, 1024, 16),
    "8b_qkv_r64": (4096, 6144, 192),
    "8b_gate_up": (4096, 24576, 32),
    "8b_down": (12288, 4096, 16),
}


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_lora_linear(dtype, shape):
    """Both block sizes; every row with a slot, some without, padding rows; with a bias."""
    (k, n, width), dev = GPU_SHAPES[shape], "cuda"
    torch.manual_seed(k + n)
    for num_rows in (1, 16, 64, 256, 512, 2048):
        for used, bias in ((num_rows, False), (max(1, num_rows - num_rows // 3), True)):
            got = check(num_rows, k, n, width, 4, used, dtype=dtype, device=dev, bias=bias)
            assert got["rel_err"] < GPU_TOLS[dtype], (num_rows, used, got)
            assert got["base_err"] < GPU_TOLS[dtype], (num_rows, used, got)


@gpu
@pytest.mark.parametrize("num_rows", [64, 600], ids=["16_row_blocks", "64_row_blocks"])
def test_gpu_lora_linear_cuda_graph(num_rows):
    """Capture over static buffers, then replay with new rows and a new block table."""
    torch.manual_seed(0)
    k, n, width, bf16 = 1024, 2048, 48, torch.bfloat16
    case = make_case(num_rows, k, n, width, random_slots(num_rows, 4, num_rows), 4, bf16, "cuda")
    lora_linear(**case)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lora_linear(**case)
    for used, share in ((num_rows, 0.0), (num_rows // 2, 0.5), (num_rows, 1.0), (1, 0.0)):
        slots = random_slots(num_rows, 4, used, share)
        new = make_case(num_rows, k, n, width, slots, 4, bf16, "cuda")
        for name in ("x", "blocks", "order"):
            case[name].copy_(new[name])
        graph.replay()
        args = [case[name].double() for name in ("x", "ext", "lora_b")]
        ref = lora_linear_reference(*args, None, row_slots(slots, num_rows).cuda())
        assert ((out.double() - ref).norm() / ref.norm()).item() < GPU_TOLS[bf16], (used, share)


if __name__ == "__main__":
    print(json.dumps(run_interpreter_cases()))
