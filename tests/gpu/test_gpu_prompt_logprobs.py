"""``SamplingParams(prompt_logprobs=k)`` on a CUDA GPU (skipped without one), float32 with Triton
attention and CUDA graphs, against transformers' float32 log_softmax on the same GPU: every entry
holds the prompt token and the reference's top k, each value within 1e-4, for a prompt computed in
chunks of 64 tokens, one whose prefix is in the prefix cache, and Qwen3-MoE beside Qwen3."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import make_random_checkpoint

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)

TOL = 1e-4
K = 5
SHAPES = {
    "qwen3": ("tiny", dict(hidden_size=256, intermediate_size=512, head_dim=128)),
    "qwen3_moe": (
        "qwen3-30b-a3b",
        dict(
            hidden_size=256,
            head_dim=128,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
        ),
    ),
}
COMMON = dict(
    vocab_size=4096,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=3,
    bos_token_id=0,
    eos_token_id=5000,
    tie_word_embeddings=False,
)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, 4096, (n,), generator=g).tolist() for n in (300, 70, 9)]


@pytest.mark.parametrize("family", list(SHAPES))
def test_prompt_logprobs_match_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM

    shape, config = SHAPES[family]
    path = make_random_checkpoint(
        str(tmp_path / family), shape, dtype=torch.bfloat16, seed=3, std=0.1, **(COMMON | config)
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    long, medium, short = prompts()
    cached = long[:256] + medium  # shares its first 256 tokens (one KV block) with `long`
    with LLM(
        path,
        dtype="float32",
        attention_backend="triton",
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    ) as llm:
        llm.generate([long], SamplingParams(max_tokens=1), use_tqdm=False)  # fills the prefix cache
        batch = [cached, long, medium, short]
        params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=K)
        outputs = llm.generate(batch, params, use_tqdm=False)
    for prompt, out in zip(batch, outputs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt], device="cuda")).logits[0, :-1].float()
        ref = torch.log_softmax(logits, dim=-1).double().cpu()
        entries = out["prompt_logprobs"]
        assert len(entries) == len(prompt) and entries[0] is None
        for i, entry in enumerate(entries[1:]):
            token, top = prompt[i + 1], ref[i].topk(K).indices.tolist()
            assert set(entry) == {token, *top}, (len(prompt), i + 1)
            for t, value in entry.items():
                assert abs(value - float(ref[i, t])) < TOL, (
                    len(prompt),
                    i + 1,
                    t,
                    value,
                    float(ref[i, t]),
                )
