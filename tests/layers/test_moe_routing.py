"""The MoE routing and grouping Triton kernels (``layers/moe/routing.py``) against their torch
references: ``select_experts`` (the same ids, weights within 1e-6) and ``group_by_expert`` (every
field of the layout, exactly), and ``fused_moe`` routed by the kernel against ``fused_moe_torch``.
Also the reference's own tie rule, and input validation.

The Triton cases run under the Triton interpreter in one subprocess (this file run as a script),
on small sizes; the Qwen3-30B-A3B sizes run on a GPU in ``tests/gpu/test_gpu_moe_routing.py``.
"""

import json
import re

import pytest
import torch
from triton_interpreter import results_under_interpreter, run_cases, squeeze_interpreter_loop_bounds

from nanovllm.layers.moe.fused import fused_moe, fused_moe_torch, group_by_expert
from nanovllm.layers.moe.layer import select_experts
from nanovllm.layers.moe.routing import (
    group_by_expert_triton,
    grouping_chunks,
    select_experts_triton,
)

WEIGHT_TOL = 1e-6  # float32 softmax: exp and the division may round differently, by an ulp or two


def tied_logits(num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    """Integer logits in [0, 4): most tokens have several experts tied at their top-k boundary."""
    return torch.randint(
        0, 4, (num_tokens, num_experts), generator=torch.Generator().manual_seed(seed)
    ).float()


def check_routing(logits: torch.Tensor, top_k: int, renormalize: bool) -> dict:
    """The kernel and the reference; ``boundary_tie``: some token's k-th and (k+1)-th logits are
    equal."""
    weights, ids = select_experts_triton(logits, top_k, renormalize)
    ref_weights, ref_ids = select_experts(logits, top_k, renormalize)
    top = logits.float().sort(dim=-1, descending=True).values
    return {
        "ids": ids.tolist(),
        "ref_ids": ref_ids.tolist(),
        "dtypes": [str(weights.dtype), str(ids.dtype)],
        "max_err": (weights - ref_weights).abs().max().item() if weights.numel() else 0.0,
        "boundary_tie": top_k < logits.shape[1]
        and bool((top[:, top_k - 1] == top[:, top_k]).any()),
    }


def routing_cases() -> dict:
    cases = {}
    for num_experts, num_tokens in ((8, 6), (60, 5), (128, 3)):
        for top_k in (1, 2, 8):
            for renormalize in (True, False):
                name = f"e{num_experts}_top{top_k}_{'renorm' if renormalize else 'plain'}"
                seed = num_experts * 100 + top_k * 2 + renormalize
                cases[f"random_{name}"] = (
                    lambda n=num_tokens, e=num_experts, k=top_k, r=renormalize, s=seed: (
                        check_routing(
                            torch.randn(n, e, generator=torch.Generator().manual_seed(s)), k, r
                        )
                    )
                )
                cases[f"ties_{name}"] = (
                    lambda n=num_tokens, e=num_experts, k=top_k, r=renormalize, s=seed: (
                        check_routing(tied_logits(n, e, s), k, r)
                    )
                )
    cases["all_equal_e60_top8"] = lambda: check_routing(torch.zeros(2, 60), 8, True)
    cases["bf16_logits_e128_top8"] = lambda: check_routing(
        torch.randn(4, 128).mul(0.1).bfloat16(), 8, True
    )
    cases["fp16_logits_strided_e60_top2"] = lambda: check_routing(
        torch.randn(3, 120).half()[:, ::2], 2, False
    )
    masked = torch.randn(3, 8)
    masked[:, [0, 3, 4]] = float(
        "-inf"
    )  # five experts left: the top 6 take one of the -inf ones, lowest id
    cases["minus_inf_e8_top6"] = lambda: check_routing(masked, 6, False)
    cases["e256_top8"] = lambda: check_routing(tied_logits(2, 256, 7), 8, True)
    cases["e5_top5"] = lambda: check_routing(torch.randn(3, 5), 5, True)
    cases["routing_tokens0"] = lambda: check_routing(torch.randn(0, 16), 2, True)
    return cases


def check_grouping(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, max_chunks: int | None = None
) -> dict:
    """Both layouts as lists; ``max_chunks`` lowers ``routing.MAX_CHUNKS`` so that a small batch
    takes several tiles per chunk."""
    from nanovllm.layers.moe import routing

    saved = routing.MAX_CHUNKS
    routing.MAX_CHUNKS = max_chunks or saved
    try:
        chunks = grouping_chunks(topk_ids.numel(), num_experts)
        groups = group_by_expert_triton(topk_ids, num_experts, block_m)
    finally:
        routing.MAX_CHUNKS = saved
    ref = group_by_expert(topk_ids, num_experts, block_m)
    return {
        "fields": [t.tolist() for t in groups],
        "ref_fields": [t.tolist() for t in ref],
        "dtypes": [str(t.dtype) for t in groups],
        "chunks": chunks,
    }


def routed_ids(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    used: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.int32,
) -> torch.Tensor:
    """Distinct experts per token drawn from the first ``used`` experts (the others stay empty)."""
    gen = torch.Generator().manual_seed(seed)
    used = used or num_experts
    ids = torch.stack([torch.randperm(used, generator=gen)[:top_k] for _ in range(num_tokens)])
    return ids.reshape(num_tokens, top_k).to(dtype)


def grouping_cases() -> dict:
    cases = {}
    sizes = (
        (1, 8, 128, (16, 32, 64)),
        (7, 2, 8, (16, 32, 64)),
        (64, 8, 60, (16, 32, 64)),
        (100, 8, 128, (32, 64)),
        (300, 8, 128, (16,)),
    )  # (tokens, top_k, experts, block_m): the interpreter is slow on many rows
    for num_tokens, top_k, num_experts, block_ms in sizes:
        for block_m in block_ms:
            cases[f"tokens{num_tokens}_top{top_k}_e{num_experts}_bm{block_m}"] = (
                lambda n=num_tokens, k=top_k, e=num_experts, b=block_m: check_grouping(
                    routed_ids(n, k, e, seed=n + b), e, b
                )
            )
    cases["empty_experts_int64"] = lambda: check_grouping(
        routed_ids(50, 4, 60, used=9, dtype=torch.int64), 60, 16
    )
    cases["all_to_one_expert"] = lambda: check_grouping(
        torch.full((100, 1), 5, dtype=torch.int32), 8, 32
    )
    cases["all_to_last_expert_top1"] = lambda: check_grouping(
        torch.full((3, 1), 127, dtype=torch.int32), 128, 16
    )
    cases["tokens1_top1"] = lambda: check_grouping(torch.tensor([[0]], dtype=torch.int32), 128, 64)
    cases["many_tiles_per_chunk"] = lambda: check_grouping(
        routed_ids(300, 8, 60, used=40, seed=3), 60, 16, max_chunks=4
    )
    cases["more_chunks_than_a_tile"] = lambda: check_grouping(
        routed_ids(140, 8, 256, seed=4), 256, 16
    )
    cases["grouping_tokens0"] = lambda: check_grouping(
        torch.zeros(0, 8, dtype=torch.int32), 128, 16
    )
    cases["block_m_1"] = lambda: check_grouping(routed_ids(20, 2, 8, seed=5), 8, 1)
    return cases


def check_fused_routed(num_tokens: int, top_k: int, num_experts: int, renormalize: bool) -> dict:
    """Router logits through the routing kernel and ``fused_moe`` (grouping kernels, grouped GEMMs)
    against ``select_experts`` and ``fused_moe_torch``, float32."""
    hidden, inter = 40, 24
    w13 = torch.randn(num_experts, 2 * inter, hidden) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter) * inter**-0.5
    x, logits = torch.randn(num_tokens, hidden), torch.randn(num_tokens, num_experts)
    out = fused_moe(x, w13, w2, *select_experts_triton(logits, top_k, renormalize))
    ref = fused_moe_torch(x, w13, w2, *select_experts(logits, top_k, renormalize))
    return {"rel_err": ((out - ref).norm() / ref.norm()).item()}


FUSED_CASES = {
    "tokens5_top2_e16_renorm": lambda: check_fused_routed(5, 2, 16, True),
    "tokens12_top8_e20_plain": lambda: check_fused_routed(12, 8, 20, False),
    "tokens100_top1_e8_renorm": lambda: check_fused_routed(100, 1, 8, True),
}
ROUTING_CASES, GROUPING_CASES = routing_cases(), grouping_cases()


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    torch.manual_seed(0)
    return run_cases({**ROUTING_CASES, **GROUPING_CASES, **FUSED_CASES})


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", list(ROUTING_CASES))
def test_routing_kernel_matches_select_experts(interpreter_results, case):
    result = interpreter_results[case]
    assert "error" not in result, result["error"]
    assert result["ids"] == result["ref_ids"]
    assert result["max_err"] <= WEIGHT_TOL, result["max_err"]
    assert result["dtypes"] == ["torch.float32", "torch.int32"]


def test_routing_cases_tie_at_the_boundary(interpreter_results):
    """The crafted ties matter: the integer and bf16 logits tie at the top-k boundary."""
    tied = [name for name, result in interpreter_results.items() if result.get("boundary_tie")]
    assert {
        "ties_e60_top8_plain",
        "ties_e128_top2_renorm",
        "all_equal_e60_top8",
        "e256_top8",
    } <= set(tied), tied
    assert not interpreter_results["random_e128_top8_plain"]["boundary_tie"]
    assert interpreter_results["all_equal_e60_top8"]["ids"] == [list(range(8))] * 2


@pytest.mark.parametrize("case", list(GROUPING_CASES))
def test_grouping_kernel_matches_group_by_expert(interpreter_results, case):
    result = interpreter_results[case]
    assert "error" not in result, result["error"]
    names = ("sorted_pairs", "block_experts", "expert_ends")
    for name, field, ref in zip(names, result["fields"], result["ref_fields"]):
        assert field == ref, name
    assert result["dtypes"] == ["torch.int32"] * 3


def test_grouping_cases_cover_several_chunks(interpreter_results):
    """(pairs per tile, pairs per chunk, chunks): one chunk of one tile, several chunks of several
    tiles, and more chunks than the 32 rows of counts summed at once for 256 experts."""
    assert interpreter_results["tokens1_top8_e128_bm16"]["chunks"] == [64, 64, 1]
    assert interpreter_results["many_tiles_per_chunk"]["chunks"] == [128, 640, 4]
    assert interpreter_results["more_chunks_than_a_tile"]["chunks"] == [32, 32, 35]


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_moe_routed_by_the_kernels(interpreter_results, case):
    result = interpreter_results[case]
    assert "error" not in result, result["error"]
    assert result["rel_err"] < 1e-5, result


def test_select_experts_is_topk_with_ties_by_id():
    """The reference: on distinct logits, torch.topk of the softmax; equal logits by ascending
    id."""
    torch.manual_seed(0)
    logits = torch.randn(50, 128)
    weights, ids = select_experts(logits, 8, renormalize=False)
    top = torch.softmax(logits, dim=-1).topk(8, dim=-1)
    assert torch.equal(ids, top.indices) and torch.equal(weights, top.values)
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 3.0]])
    assert select_experts(logits, 5, renormalize=True)[1].tolist() == [[1, 2, 4, 6, 3]]


def test_grouping_chunk_sizes():
    """Decode is one chunk of one tile per 64 pairs (128 experts); a 16k-token prefill is 256
    chunks."""
    assert grouping_chunks(8, 128) == (64, 64, 1)
    assert grouping_chunks(512 * 8, 128) == (64, 64, 64)
    assert grouping_chunks(16384 * 8, 128) == (64, 512, 256)
    assert grouping_chunks(16384 * 8 + 1, 128) == (64, 576, 228)
    assert grouping_chunks(10, 8) == (128, 128, 1)


BAD_CALLS = [
    (
        lambda: select_experts_triton(torch.randn(3), 1, True),
        "router_logits must be a floating-point [num_tokens, num_experts] tensor, got shape (3,)",
    ),
    (
        lambda: select_experts_triton(torch.ones(3, 4, dtype=torch.int32), 1, True),
        "dtype torch.int32",
    ),
    (
        lambda: select_experts_triton(torch.randn(3, 257), 1, True),
        "num_experts must be in [1, 256] for the routing kernel, got 257",
    ),
    (
        lambda: select_experts_triton(torch.randn(3, 4), 5, True),
        "top_k must be an int in [1, num_experts=4], got 5",
    ),
    (
        lambda: select_experts_triton(torch.randn(3, 4), 0, True),
        "top_k must be an int in [1, num_experts=4], got 0",
    ),
    (
        lambda: group_by_expert_triton(torch.zeros(3, 2), 4, 16),
        "topk_ids must be an int32 or int64 [num_tokens, top_k] tensor",
    ),
    (lambda: group_by_expert_triton(torch.zeros(6, dtype=torch.int32), 4, 16), "got shape (6,)"),
    (
        lambda: group_by_expert_triton(torch.zeros(3, 2, dtype=torch.int32), 300, 16),
        "num_experts must be in [1, 256] for the grouping kernels, got 300",
    ),
    (
        lambda: group_by_expert_triton(torch.zeros(3, 2, dtype=torch.int32), 4, 0),
        "block_m must be a positive int, got 0",
    ),
]


@pytest.mark.parametrize("call,message", BAD_CALLS, ids=[str(i) for i in range(len(BAD_CALLS))])
def test_rejects_bad_inputs(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


if __name__ == "__main__":
    print(json.dumps(run_interpreter_cases()))
