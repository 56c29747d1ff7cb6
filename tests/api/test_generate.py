"""``generate``: the model folder's default sampling params, outputs made as each request
finishes, and prompts as arrays and tensors.

The references never come from the code under test: greedy loops over Hugging Face transformers
written in ``api_helpers.py`` (penalties, masked ids and stop conditions applied to its logits),
transformers log-softmax for logprobs, the Hugging Face tokenizer for texts and chat templates, and
exact block ids on fresh engines.
"""

import numpy as np
import pytest
import torch
from api_helpers import assert_idle, copy_checkpoint, greedy, make_llm
from hf_reference import assert_greedy_match, random_prompts

from nanovllm import SamplingParams

# ---- default sampling params ----------------------------------------------------------------


@pytest.mark.parametrize(
    "generation_config, expected",
    [
        pytest.param("keep", SamplingParams(temperature=0.6, top_p=0.95, top_k=20), id="qwen3"),
        pytest.param(None, SamplingParams(), id="no-file"),
        pytest.param(
            {"temperature": 0.3, "repetition_penalty": 1.2},
            SamplingParams(temperature=0.3, repetition_penalty=1.2),
            id="temperature-repetition",
        ),
        pytest.param(
            {"temperature": 0.3, "top_k": None, "do_sample": True},
            SamplingParams(temperature=0.3),
            id="null-values-skipped",
        ),
        pytest.param(
            {"max_new_tokens": 7, "min_p": 0.05},
            SamplingParams(max_tokens=7, min_p=0.05),
            id="max-new-tokens",
        ),
    ],
)
def test_default_sampling_params(ckpt_tied, tmp_path, generation_config, expected):
    path = copy_checkpoint(
        ckpt_tied.path, str(tmp_path / "model"), generation_config=generation_config
    )
    with make_llm(path, num_kvcache_blocks=8) as llm:
        assert llm.get_default_sampling_params() == expected


def test_generate_without_params_uses_defaults(ckpt_tied, hf_ref, tmp_path):
    path = copy_checkpoint(
        ckpt_tied.path, str(tmp_path / "model"), generation_config={"temperature": 0.0}
    )
    prompt = random_prompts(110, [11])[0]
    with make_llm(
        path, num_kvcache_blocks=8, max_model_len=24
    ) as llm:  # max_model_len ends it early
        out = llm.generate([prompt], use_tqdm=False)[0]
    assert len(out["token_ids"]) == 24 - len(prompt) and out["finish_reason"] == "length"
    ref = hf_ref.greedy(ckpt_tied.path, prompt, 24 - len(prompt))
    assert_greedy_match(
        out["token_ids"], ref, "generate(prompts) with the folder's defaults (temperature 0)"
    )


def test_generate_makes_each_output_when_its_request_finishes(llm):
    """A request's output (its text decoded) is made in the step loop once it finishes, while the
    others still run, not after the last step; the returned list is still in prompt order."""
    prompts = random_prompts(131, [5, 7, 9])
    made = []
    make = llm.outputs.request_output

    def record(request_id):
        out = make(request_id)
        made.append((out["prompt_token_ids"], len(llm.core.scheduler.running)))
        return out

    llm.outputs.request_output = record
    try:
        outputs = llm.generate(prompts, [greedy(20), greedy(2), greedy(20)], use_tqdm=False)
    finally:
        del llm.outputs.request_output
    assert made[0] == (prompts[1], 2)  # the short request, while both long ones still decode
    assert sorted(p for p, _ in made) == sorted(prompts) and len(made) == 3
    assert [len(o["token_ids"]) for o in outputs] == [20, 2, 20]
    assert [o["prompt_token_ids"] for o in outputs] == prompts
    assert_idle(llm)


# ---- prompts as arrays and tensors ----------------------------------------------------------


def test_prompts_as_arrays_and_tensors(llm, ckpt_tied, hf_ref):
    prompt = random_prompts(120, [19])[0]
    forms = [
        prompt,
        tuple(prompt),
        np.array(prompt, dtype=np.int64),
        np.array(prompt, dtype=np.int32),
        torch.tensor(prompt),
        torch.tensor(prompt, dtype=torch.int32),
        [np.int64(t) for t in prompt],
    ]
    outputs = llm.generate(forms, greedy(6), use_tqdm=False)
    ref = hf_ref.greedy(ckpt_tied.path, prompt, 6)
    for i, out in enumerate(outputs):
        assert out["prompt_token_ids"] == prompt and all(
            type(t) is int for t in out["prompt_token_ids"]
        ), f"form {i}"
        assert out["token_ids"] == outputs[0]["token_ids"], f"form {i}"
    assert_greedy_match(outputs[0]["token_ids"], ref, "list prompt")
    single = llm.generate(np.array(prompt), greedy(6), use_tqdm=False)  # one array: one prompt
    assert len(single) == 1 and single[0]["token_ids"] == outputs[0]["token_ids"]
    assert_idle(llm)


@pytest.mark.parametrize(
    "bad, words",
    [
        pytest.param(torch.tensor([[1, 2, 3]]), ["2-D", "(1, 3)"], id="2-d-tensor"),
        pytest.param(np.array([1.0, 2.0]), ["1.0"], id="float-array"),
        pytest.param(torch.tensor([1.5, 2.0]), ["1.5"], id="float-tensor"),
        pytest.param([np.float64(3.0)], ["3.0"], id="list-of-np-float"),
    ],
)
def test_bad_array_prompt(llm, bad, words):
    prompts = random_prompts(121, [4, 9])
    with pytest.raises(TypeError) as e:
        llm.generate([prompts[0], prompts[1], bad], greedy(4), use_tqdm=False)
    message = str(e.value)
    assert "prompts[2]" in message, message
    assert any(w in message for w in words), message
    assert_idle(llm)
