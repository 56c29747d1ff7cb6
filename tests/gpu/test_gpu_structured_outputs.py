"""Structured outputs on CUDA GPUs (skipped without one): with CUDA graphs and async scheduling,
the decode steps with grammar rows sample from the graphs' logits through the masked sampler (not
the graphs' fused draw), and every constrained completion is in its grammar's language, beside
unconstrained requests; on one GPU and, with two, tensor-parallel (the mask on rank 0 only)."""

import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.utils.checkpoint import make_random_checkpoint

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)

EOS_IDS = (151643, 151645)
SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["a", "b"]}, "ok": {"type": "boolean"}},
    "required": ["label", "ok"],
}
# finite languages: a random model ends every one of them well within max_tokens
SPECS = [
    StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
    StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
    StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
]


def in_language(so: StructuredOutputsParams, text: str) -> bool:
    if so.choice is not None:
        return text in so.choice
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    value = json.loads(text)
    return (
        text == json.dumps(value, separators=(",", ":"))
        and set(value) == {"label", "ok"}
        and value["label"] in ("a", "b")
        and isinstance(value["ok"], bool)
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_constrained_completions_under_cuda_graphs(tmp_path, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    # head_dim 128: the only one a minimal flash-attn build has, which "auto" picks where present
    path = make_random_checkpoint(
        str(tmp_path / "qwen3"), dtype=torch.bfloat16, seed=3, std=0.3, head_dim=128
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    params = [
        SamplingParams(temperature=1.0, max_tokens=64, seed=i, structured_outputs=SPECS[i % 3])
        for i in range(24)
    ]
    free = [
        SamplingParams(temperature=1.0, max_tokens=32, seed=100 + i, ignore_eos=True)
        for i in range(8)
    ]
    prompts = [f"Request number {i}:" for i in range(len(params) + len(free))]
    with LLM(path, tensor_parallel_size=tp, max_model_len=1024, max_num_seqs=64) as llm:
        outputs = llm.generate(prompts, params + free, use_tqdm=False)
    for out, sp in zip(outputs, params):
        assert out["finish_reason"] == "stop" and out["token_ids"][-1] in EOS_IDS, out
        assert out["text"] == tokenizer.decode(out["token_ids"][:-1], skip_special_tokens=True)
        assert in_language(sp.structured_outputs, out["text"]), out["text"]
    for out in outputs[len(params) :]:
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 32
