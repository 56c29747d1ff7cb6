"""The fused MoE Triton kernels and the torch path against a float64 reference written from the
definition, the expert grouping's exact layout, tile choice and input validation.

On the CPU the Triton cases run under the Triton interpreter (in one subprocess: this file run as a
script), in float32 with small dims that are not multiples of any tile. On a CUDA GPU, Qwen3-30B-A3B
shapes against ``fused_moe_torch`` in float32 and bf16, and a CUDA-graph capture with new routings
replayed through the static buffers.
"""

import json
import re

import pytest
import torch
from triton_interpreter import results_under_interpreter, run_cases, squeeze_interpreter_loop_bounds

from nanovllm.layers.moe.fused import (
    MoeTile,
    fused_moe,
    fused_moe_torch,
    group_by_expert,
    max_padded_rows,
    moe_tile,
    shared_memory_estimate,
)

I32, I64 = torch.int32, torch.int64


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def reference_moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """float64, straight from the definition, for every (token, k) pair at once."""
    inter = w13.shape[1] // 2
    ids = topk_ids.long()
    gate_up = torch.einsum(
        "tkoh,th->tko", w13.double()[ids], x.double()
    )  # [tokens, top_k, 2 * inter]
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    h = gate / (1.0 + torch.exp(-gate)) * up
    y = torch.einsum("tkhi,tki->tkh", w2.double()[ids], h)  # [tokens, top_k, hidden]
    return (y * topk_weights.double()[..., None]).sum(dim=1)


def make_routing(num_tokens, top_k, num_experts, *, skew=True, id_dtype=I64, device="cpu"):
    """Distinct experts per token and positive weights summing to 1. With ``skew`` expert 0 is
    drawn 40 times as often as the others and the last expert never; otherwise uniform."""
    probs = torch.ones(num_experts)
    if skew:
        probs[0], probs[-1] = 40.0, 0.0
    ids = torch.multinomial(probs.expand(num_tokens, -1), top_k, replacement=False)
    weights = torch.rand(num_tokens, top_k).add_(0.1)
    weights /= weights.sum(dim=1, keepdim=True)
    return weights.to(device), ids.to(id_dtype).to(device)


def make_weights(num_experts, hidden, inter, dtype, device="cpu", transposed=False):
    """w13 [E, 2 * inter, hidden] and w2 [E, hidden, inter], scaled by 1/sqrt(fan_in).
    ``transposed``: w13 as a view of [E, hidden, 2 * inter] storage (its reduction dim not
    contiguous)."""
    if transposed:
        w13 = torch.randn(num_experts, hidden, 2 * inter, device=device).transpose(1, 2)
    else:
        w13 = torch.randn(num_experts, 2 * inter, hidden, device=device)
    w2 = torch.randn(num_experts, hidden, inter, device=device)
    return (w13 * hidden**-0.5).to(dtype), (w2 * inter**-0.5).to(dtype)


def check_fused(
    num_tokens,
    top_k,
    *,
    hidden=40,
    inter=24,
    num_experts=16,
    dtype=torch.float32,
    tile=None,
    id_dtype=I64,
    skew=True,
    routing=None,
    strided=False,
    transposed=False,
) -> dict:
    """fused_moe against ``reference_moe``. ``strided``: hidden_states a column view of a wider
    tensor."""
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, transposed=transposed)
    x = torch.randn(num_tokens, 2 * hidden if strided else hidden).to(dtype)
    x = x[:, ::2] if strided else x
    topk_weights, topk_ids = routing or make_routing(
        num_tokens, top_k, num_experts, skew=skew, id_dtype=id_dtype
    )
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, tile=tile)
    ref = reference_moe(x, w13, w2, topk_weights, topk_ids)
    loads = torch.bincount(topk_ids.flatten(), minlength=num_experts)  # pairs per expert
    return {
        "rel_err": relative_error(out, ref) if num_tokens else 0.0,
        "shape_ok": out.shape == x.shape and out.dtype == dtype,
        "finite": bool(out.isfinite().all()),
        "loads": loads.tolist(),
    }


SMALL_TILE = MoeTile(
    16, 16, 16, 4, 1
)  # several N tiles and K steps, with partial edges, on the small dims
CPU_TOL = 1e-5  # float32 against float64
FP16_TOL = (
    2e-3  # fp16 rounding of x, weights, intermediate and per-pair outputs: a few units of 2**-11
)
INTERPRETER_CASES = {
    "tokens1_top1": lambda: check_fused(1, 1),
    "tokens1_top2": lambda: check_fused(1, 2),
    "tokens1_top8": lambda: check_fused(1, 8, id_dtype=I32),
    "tokens2_top2": lambda: check_fused(2, 2),
    "tokens7_top1": lambda: check_fused(7, 1, id_dtype=I32),
    "tokens7_top8": lambda: check_fused(7, 8),
    "tokens64_top1": lambda: check_fused(64, 1),
    "tokens64_top2": lambda: check_fused(64, 2, skew=False),
    "tokens64_top8": lambda: check_fused(64, 8),
    "tokens300_top8": lambda: check_fused(300, 8, id_dtype=I32),
    "tokens700_top2": lambda: check_fused(700, 2),
    "tokens0": lambda: check_fused(0, 2),
    "all_to_one_expert": lambda: check_fused(
        64, 1, routing=(torch.ones(64, 1), torch.full((64, 1), 5, dtype=I32))
    ),
    "small_tile_tokens7_top8": lambda: check_fused(7, 8, tile=SMALL_TILE),
    "small_tile_tokens64_top8": lambda: check_fused(64, 8, tile=SMALL_TILE),
    "small_tile_tokens300_top2": lambda: check_fused(300, 2, tile=SMALL_TILE, id_dtype=I32),
    # hidden 80 and inter 72 over 64-wide tiles: two K steps with a partial second one
    "wide_tokens600_top2": lambda: check_fused(600, 2, hidden=80, inter=72),
    "wide_tokens64_top8": lambda: check_fused(64, 8, hidden=80, inter=72),
    "strided_inputs": lambda: check_fused(64, 2, strided=True, transposed=True, tile=SMALL_TILE),
    "fp16": lambda: check_fused(64, 2, dtype=torch.float16),
    "sum_pairs": lambda: check_sum_pairs(),
}


def check_sum_pairs(num_tokens=5, top_k=8, hidden=1100) -> dict:
    """``sum_pairs`` against each token's rows added in float32 in k order: the same float32 bits
    (float32 rows, so another order rounds differently; hidden over 1,024-wide programs, so a
    partial second one)."""
    from nanovllm.layers.moe.triton_kernels import sum_pairs

    pairs = torch.randn(num_tokens * top_k, hidden)
    expected = pairs[0::top_k]
    for k in range(1, top_k):
        expected = expected + pairs[k::top_k]
    out = sum_pairs(pairs, top_k, torch.float32)
    return {
        "equal": torch.equal(out, expected),
        "empty_shape": list(sum_pairs(pairs[:0], top_k, torch.float32).shape),
    }


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    torch.manual_seed(0)
    return run_cases(INTERPRETER_CASES)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", [case for case in INTERPRETER_CASES if case != "sum_pairs"])
def test_fused_moe_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    assert "error" not in result, result["error"]
    assert result["shape_ok"] and result["finite"], result
    assert result["rel_err"] < (FP16_TOL if case == "fp16" else CPU_TOL), result


def test_sum_pairs_adds_in_k_order(interpreter_results):
    result = interpreter_results["sum_pairs"]
    assert "error" not in result, result["error"]
    assert result["equal"] and result["empty_shape"] == [0, 1100], result


def test_interpreter_routings_are_uneven(interpreter_results):
    """The skewed routings give expert 0 the most pairs (with top-8, every token) and the last
    none."""
    for case in ("tokens64_top1", "tokens300_top8", "tokens700_top2"):
        loads = interpreter_results[case]["loads"]
        assert loads[-1] == 0 and loads[0] > 1.5 * sorted(loads)[-2], (case, loads)
    assert interpreter_results["tokens300_top8"]["loads"][0] == 300


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (7, 8), (64, 2), (300, 8)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_fused_moe_torch_matches_reference(num_tokens, top_k, id_dtype):
    torch.manual_seed(num_tokens)
    w13, w2 = make_weights(16, 40, 24, torch.float32)
    x = torch.randn(num_tokens, 40)
    topk_weights, topk_ids = make_routing(num_tokens, top_k, 16, id_dtype=id_dtype)
    out = fused_moe_torch(x, w13, w2, topk_weights, topk_ids)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert relative_error(out, reference_moe(x, w13, w2, topk_weights, topk_ids)) < CPU_TOL


def test_fused_moe_torch_keeps_dtype():
    w13, w2 = make_weights(4, 40, 24, torch.bfloat16)
    x = torch.randn(5, 40).bfloat16()
    topk_weights, topk_ids = make_routing(5, 2, 4, skew=False)
    out = fused_moe_torch(x, w13, w2, topk_weights, topk_ids)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference_moe(x, w13, w2, topk_weights, topk_ids)) < 2**-8


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_group_by_expert_layout(block_m):
    """Each expert's pairs, ascending, then sentinels up to a multiple of block_m, experts in order;
    sentinels after the last group; the expert of every block."""
    torch.manual_seed(block_m)
    num_experts, top_k = 6, 2
    _, topk_ids = make_routing(23, top_k, num_experts)  # expert 5 gets none
    num_pairs = topk_ids.numel()
    groups = group_by_expert(topk_ids.int(), num_experts, block_m)
    flat = topk_ids.flatten().tolist()
    expected, block_experts, ends = [], [], []
    for expert in range(num_experts):
        pairs = [p for p in range(num_pairs) if flat[p] == expert]
        padded = -(-len(pairs) // block_m) * block_m
        expected += pairs + [num_pairs] * (padded - len(pairs))
        block_experts += [expert] * (padded // block_m)
        ends.append(len(expected))
    num_rows = max_padded_rows(num_pairs, num_experts, block_m)
    expected += [num_pairs] * (num_rows - len(expected))
    block_experts += [num_experts] * (num_rows // block_m - len(block_experts))
    assert (
        groups.sorted_pairs.dtype
        == groups.block_experts.dtype
        == groups.expert_ends.dtype
        == torch.int32
    )
    assert groups.sorted_pairs.tolist() == expected
    assert groups.block_experts.tolist() == block_experts
    assert groups.expert_ends.tolist() == ends


def test_max_padded_rows_is_the_worst_case():
    """Every expert that gets a pair may leave block_m - 1 rows of padding."""
    assert (
        max_padded_rows(8, 128, 16) == 8 + 8 * 15
    )  # one decode token, top-8: at most 8 experts used
    assert max_padded_rows(4096, 128, 64) == 4096 + 128 * 63
    assert max_padded_rows(46, 6, 16) == 128  # 46 + 6 * 15 = 136 rows, of which whole blocks: 8
    _, topk_ids = make_routing(1, 8, 128, skew=False)
    groups = group_by_expert(topk_ids, 128, 16)
    assert (
        groups.expert_ends[-1].item() == groups.sorted_pairs.numel() == 128
    )  # 8 groups of 1 pair, all padded


def test_moe_tile_choice():
    """BLOCK_M follows the mean rows per expert (Qwen3-30B-A3B: 128 experts, top 8); every tile
    fits the H100's shared memory per block in bf16 and float32."""
    block_m = [moe_tile(n, 8, 128, 2).block_m for n in (1, 64, 256, 257, 1024, 4096, 16384)]
    assert block_m == [16, 16, 16, 32, 64, 64, 128]
    assert moe_tile(1, 2, 16, 4) == MoeTile(16, 32, 128, 4, 2)
    for n in (1, 300, 1024, 4096, 16384):
        for itemsize in (2, 4):
            assert shared_memory_estimate(moe_tile(n, 8, 128, itemsize), itemsize) <= 232448, (
                n,
                itemsize,
            )


def valid_inputs() -> dict:
    """3 tokens, hidden 8, inter 4, 4 experts, top-2."""
    w13, w2 = make_weights(4, 8, 4, torch.float32)
    topk_weights, topk_ids = make_routing(3, 2, 4, skew=False)
    return dict(
        hidden_states=torch.randn(3, 8),
        w13=w13,
        w2=w2,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
    )


DTYPES = "(torch.bfloat16, torch.float16, torch.float32)"
# (argument, bad value over valid_inputs(), the message it must raise)
BAD_INPUTS = [
    (
        "hidden_states",
        torch.randn(3, 8, 1),
        "hidden_states must be [num_tokens, hidden], got shape (3, 8, 1)",
    ),
    (
        "hidden_states",
        torch.ones(3, 8, dtype=I32),
        f"hidden_states.dtype must be one of {DTYPES}, got torch.int32",
    ),
    (
        "w13",
        torch.randn(4, 8, 9),
        "w13 must be [num_experts, 2 * inter, hidden=8], got shape (4, 8, 9)",
    ),
    (
        "w13",
        torch.randn(4, 7, 8),
        "w13 must be [num_experts, 2 * inter, hidden=8], got shape (4, 7, 8)",
    ),
    (
        "w13",
        torch.randn(4, 8, 8).half(),
        "w13.dtype must equal hidden_states.dtype (torch.float32), got torch.float16",
    ),
    (
        "w2",
        torch.randn(4, 8, 5),
        "w2 must be [num_experts=4, hidden=8, inter=4] like w13, got shape (4, 8, 5)",
    ),
    (
        "w2",
        torch.randn(3, 8, 4),
        "w2 must be [num_experts=4, hidden=8, inter=4] like w13, got shape (3, 8, 4)",
    ),
    (
        "topk_ids",
        torch.zeros(2, 2, dtype=I64),
        "topk_ids must be [num_tokens=3, top_k], got shape (2, 2)",
    ),
    (
        "topk_ids",
        torch.zeros(3, 2),
        "topk_ids.dtype must be torch.int32 or torch.int64, got torch.float32",
    ),
    (
        "topk_ids",
        torch.zeros(3, 5, dtype=I64),
        "top_k must be between 1 and num_experts (4), got 5",
    ),
    (
        "topk_ids",
        torch.zeros(3, 0, dtype=I64),
        "top_k must be between 1 and num_experts (4), got 0",
    ),
    ("topk_weights", torch.ones(3, 1), "topk_weights must have topk_ids' shape (3, 2), got (3, 1)"),
    (
        "topk_weights",
        torch.ones(3, 2).half(),
        "topk_weights.dtype must be torch.float32, got torch.float16",
    ),
]


@pytest.mark.parametrize("fn", [fused_moe, fused_moe_torch], ids=["fused_moe", "fused_moe_torch"])
@pytest.mark.parametrize(
    "name,value,message", BAD_INPUTS, ids=[f"{i}-{case[0]}" for i, case in enumerate(BAD_INPUTS)]
)
def test_rejects_bad_inputs(fn, name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(**{**valid_inputs(), name: value})


# ---- GPU: Qwen3-30B-A3B shapes against fused_moe_torch -------------------------------------------

gpu = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)
GPU_TOKENS = [1, 2, 7, 64, 333, 1024, 4096]
NUM_EXPERTS, HIDDEN, TOP_K = 128, 2048, 8  # Qwen3-30B-A3B
GPU_FP32_TOL = 1e-5  # IEEE float32 dots on both sides; only the summation order differs
# bf16 keeps 8 significant bits (unit roundoff 2**-9). Both sides see the same bf16 inputs; the
# kernel also rounds the intermediate and each pair's output to bf16, the final output is rounded
# on both sides: a few roundings of 2**-9 relative each, so the norm-relative error stays well
# under 2.5 * 2**-8 ~ 1e-2.
GPU_BF16_TOL = 1e-2


def _gpu_weights(inter: int, dtype: torch.dtype):
    torch.manual_seed(inter)
    return make_weights(NUM_EXPERTS, HIDDEN, inter, dtype, device="cuda")


@gpu
@pytest.mark.parametrize(
    "dtype,tol",
    [(torch.float32, GPU_FP32_TOL), (torch.bfloat16, GPU_BF16_TOL)],
    ids=["fp32", "bf16"],
)
@pytest.mark.parametrize("inter", [768, 384])  # Qwen3-30B-A3B's moe_intermediate_size at TP 1 and 2
def test_gpu_fused_moe(dtype, tol, inter):
    w13, w2 = _gpu_weights(inter, dtype)
    for num_tokens in GPU_TOKENS:
        for skew in (False, True):
            x = torch.randn(num_tokens, HIDDEN, device="cuda").to(dtype)
            routing = make_routing(
                num_tokens, TOP_K, NUM_EXPERTS, skew=skew, id_dtype=I32, device="cuda"
            )
            out = fused_moe(x, w13, w2, *routing)
            ref = fused_moe_torch(x, w13, w2, *routing)
            assert out.shape == x.shape and out.dtype == dtype and out.isfinite().all()
            assert relative_error(out, ref) < tol, (num_tokens, skew)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 512])
def test_gpu_fused_moe_cuda_graph(num_tokens):
    """Capture once over static inputs, then replay with new hidden states and routings copied
    in."""
    w13, w2 = _gpu_weights(384, torch.bfloat16)
    x = torch.zeros(num_tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
    topk_weights, topk_ids = make_routing(
        num_tokens, TOP_K, NUM_EXPERTS, id_dtype=I32, device="cuda"
    )
    fused_moe(x, w13, w2, topk_weights, topk_ids)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, topk_weights, topk_ids)
    for skew in (False, True, False):
        new_weights, new_ids = make_routing(
            num_tokens, TOP_K, NUM_EXPERTS, skew=skew, id_dtype=I32, device="cuda"
        )
        x.copy_(torch.randn_like(x))
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        ref = fused_moe_torch(x, w13, w2, topk_weights, topk_ids)
        assert out.isfinite().all()
        assert relative_error(out, ref) < GPU_BF16_TOL, skew


if __name__ == "__main__":
    print(json.dumps(run_interpreter_cases()))
