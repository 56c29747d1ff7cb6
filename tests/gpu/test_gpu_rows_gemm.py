"""The few-rows linear (``layers/rows_gemm.py``) on a CUDA GPU (skipped without one): against
``F.linear`` in float32 on the GPU's own inputs (TMA loads, programmatic dependent launch, K cut
into ranges), within one bf16 rounding step, also replayed in a CUDA graph (the arrival counters
set back); a bf16 engine's decode with it gives the tokens of one without it."""

import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers import rows_gemm
from nanovllm.layers.rows_gemm import rows_linear

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)


def within_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(((got.float() - want).abs() <= 2**-8 * want.abs() + 1e-4).all())


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (300, 200), (6144, 4096)])
def test_rows_linear_matches_float32(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, 2 * k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    assert within_rounding(rows_linear(x[:, :k], w), x[:, :k].float() @ w.float().T)
    assert within_rounding(rows_linear(x[:, :k], w, b), x[:, :k].float() @ w.float().T + b.float())
    gate, up = x.float().chunk(2, dim=-1)
    h = (F.silu(gate) * up).bfloat16().float()
    assert within_rounding(rows_linear(x, w, gated=True), h @ w.float().T)


def test_rows_linear_in_a_cuda_graph_repeats():
    x = torch.randn(3, 4096, device="cuda").bfloat16()
    w = (torch.randn(4096, 4096, device="cuda") * 0.02).bfloat16()
    eager = rows_linear(x, w, splits=8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rows_linear(x, w, splits=8)
    outs = []
    for _ in range(3):
        graph.replay()
        outs.append(out.clone())
    assert all(torch.equal(o, eager) for o in outs)


def test_engine_tokens_with_and_without_the_kernel(tmp_path, monkeypatch):
    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.checkpoint import make_random_checkpoint

    shape = dict(hidden_size=256, intermediate_size=512, head_dim=128, num_hidden_layers=3)
    path = make_random_checkpoint(str(tmp_path), "tiny", dtype=torch.bfloat16, **shape)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[1 + i, 2 + i, 3 + i] * (i + 1) for i in range(4)]
    tokens = {}
    for enabled in (True, False):
        monkeypatch.setattr(rows_gemm, "ENABLED", enabled)
        with LLM(path, max_model_len=256) as llm:
            out = llm.generate(prompts, params, use_tqdm=False)
        tokens[enabled] = [o.outputs[0].token_ids for o in out]
    # bf16 sums in another order may break a near-tie; on these few tokens none is expected
    assert tokens[True] == tokens[False]
