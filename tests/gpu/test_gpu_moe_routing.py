"""The MoE routing and grouping Triton kernels on a CUDA GPU (skipped without one), at
Qwen3-30B-A3B's sizes (128 experts, top-8) from one decode token to a 16k-token prefill: the same
ids and layouts as the torch references, and one MoE step (routing, grouping, grouped GEMMs)
captured in a CUDA graph and replayed with new router logits."""

import pytest
import torch

from nanovllm.layers.moe.fused import fused_moe, fused_moe_torch, group_by_expert, moe_tile
from nanovllm.layers.moe.layer import route, select_experts
from nanovllm.layers.moe.routing import group_by_expert_triton, select_experts_triton

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)

NUM_EXPERTS, TOP_K, HIDDEN, INTER = (
    128,
    8,
    2048,
    384,
)  # Qwen3-30B-A3B, moe_intermediate_size at TP 2
TOKENS = [1, 2, 7, 64, 333, 512, 1024, 4096, 16384]
WEIGHT_TOL = 1e-6  # float32 probabilities; the GPU's exp differs from torch's by an ulp or two
BF16_TOL = 1e-2  # fused_moe against fused_moe_torch in bf16 (see tests/layers/test_fused_moe.py)


def router_logits(num_tokens: int, dtype: torch.dtype, skew: bool = False) -> torch.Tensor:
    """N(0, 1) logits; ``skew`` favours the first 8 experts, so that they get most pairs."""
    logits = torch.randn(num_tokens, NUM_EXPERTS, device="cuda")
    if skew:
        logits[:, :8] += 2.0
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
def test_gpu_routing_matches_select_experts(dtype, renormalize):
    """bf16 logits tie often (8 significant bits over 128 experts): the tie rule is exercised."""
    torch.manual_seed(0)
    for num_tokens in TOKENS:
        logits = router_logits(num_tokens, dtype)
        weights, ids = select_experts_triton(logits, TOP_K, renormalize)
        ref_weights, ref_ids = select_experts(logits, TOP_K, renormalize)
        assert torch.equal(ids.long(), ref_ids), num_tokens
        assert (weights - ref_weights).abs().max().item() <= WEIGHT_TOL, num_tokens
    top = router_logits(4096, torch.bfloat16).float().sort(dim=-1, descending=True).values
    assert (top[:, TOP_K - 1] == top[:, TOP_K]).any()  # ties at the boundary do occur


@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_gpu_grouping_matches_group_by_expert(skew):
    """Every field, for the block_m that ``moe_tile`` picks at each size and for 16."""
    torch.manual_seed(1)
    for num_tokens in TOKENS:
        _, ids = select_experts_triton(router_logits(num_tokens, torch.float32, skew), TOP_K, True)
        for block_m in sorted({16, moe_tile(num_tokens, TOP_K, NUM_EXPERTS, 2).block_m}):
            groups = group_by_expert_triton(ids, NUM_EXPERTS, block_m)
            ref = group_by_expert(ids, NUM_EXPERTS, block_m)
            for name, field, expected in zip(ref._fields, groups, ref):
                assert torch.equal(field, expected), (num_tokens, block_m, name)


def test_gpu_grouping_all_pairs_to_one_expert():
    ids = torch.full((16384, 1), 77, dtype=torch.int32, device="cuda")
    for block_m in (16, 128):
        groups, ref = (
            group_by_expert_triton(ids, NUM_EXPERTS, block_m),
            group_by_expert(ids, NUM_EXPERTS, block_m),
        )
        assert all(torch.equal(a, b) for a, b in zip(groups, ref)), block_m


@pytest.mark.parametrize("num_tokens", [1, 64, 512])
def test_gpu_moe_step_in_cuda_graph(num_tokens):
    """Routing, grouping and the grouped GEMMs captured once, replayed with new logits copied in."""
    torch.manual_seed(2)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device="cuda") * HIDDEN**-0.5).bfloat16()
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, device="cuda") * INTER**-0.5).bfloat16()
    x = torch.randn(num_tokens, HIDDEN, device="cuda").bfloat16()
    logits = router_logits(num_tokens, torch.bfloat16)

    def step():
        return fused_moe(x, w13, w2, *route(logits, TOP_K, True))

    step()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for skew in (False, True, False):
        logits.copy_(router_logits(num_tokens, torch.bfloat16, skew))
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        ref = fused_moe_torch(x, w13, w2, *select_experts(logits, TOP_K, True))
        assert out.isfinite().all()
        assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() < BF16_TOL, skew
