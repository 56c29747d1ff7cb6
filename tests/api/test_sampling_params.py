"""Every invalid ``SamplingParams`` value, rejected with the field named; stop token ids
outside the vocabulary.

The references never come from the code under test: greedy loops over Hugging Face transformers
written in ``api_helpers.py`` (penalties, masked ids and stop conditions applied to its logits),
transformers log-softmax for logprobs, the Hugging Face tokenizer for texts and chat templates, and
exact block ids on fresh engines.
"""

import math

import pytest
from api_helpers import assert_idle, assert_serves_correctly, greedy
from hf_reference import VOCAB_SIZE, random_prompts

from nanovllm import SamplingParams

# ---- invalid SamplingParams -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("top_p", 0, ValueError),
        ("top_p", 1.5, ValueError),
        ("top_p", math.nan, ValueError),
        ("top_p", "x", TypeError),
        ("top_k", -2, ValueError),
        ("top_k", 1.5, TypeError),
        ("min_p", -0.1, ValueError),
        ("min_p", 1.1, ValueError),
        ("seed", 1.5, TypeError),
        ("stop", 3, TypeError),
        ("stop", [""], ValueError),
        ("stop", ["a", 1], TypeError),
        ("stop_token_ids", [-1], ValueError),
        ("stop_token_ids", "x", TypeError),
        ("stop_token_ids", [1.0], TypeError),
        ("include_stop_str_in_output", "yes", TypeError),
        ("min_tokens", -1, ValueError),
        ("repetition_penalty", 0, ValueError),
        ("repetition_penalty", -1, ValueError),
        ("repetition_penalty", math.inf, ValueError),
        ("presence_penalty", 2.5, ValueError),
        ("frequency_penalty", -3, ValueError),
        ("logprobs", -2, ValueError),
        ("logprobs", 1.5, TypeError),
        ("n", 0, ValueError),
        ("n", 2.0, TypeError),
        ("skip_special_tokens", 1, TypeError),
    ],
)
def test_invalid_sampling_param(field, value, exc):
    with pytest.raises(exc) as e:
        SamplingParams(**{field: value})
    message = str(e.value)
    assert field in message and str(value) in message, message


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError) as e:
        SamplingParams(max_tokens=5, min_tokens=6)
    message = str(e.value)
    assert "min_tokens" in message and "6" in message and "5" in message, message
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5


def test_stop_token_ids_outside_vocabulary(llm, ckpt_tied, hf_ref):
    prompts = random_prompts(130, [5, 8])
    with pytest.raises(ValueError) as e:
        llm.generate(
            prompts,
            [greedy(4, stop_token_ids=[VOCAB_SIZE - 1]), greedy(4, stop_token_ids=[3, VOCAB_SIZE])],
            use_tqdm=False,
        )
    message = str(e.value)
    assert "prompts[1]" in message and str(VOCAB_SIZE) in message and "stop_token_ids" in message, (
        message
    )
    assert_idle(llm)
    with pytest.raises(ValueError, match=str(VOCAB_SIZE)):
        llm.add_request(prompts[0], greedy(4, stop_token_ids=[VOCAB_SIZE]))
    assert_idle(llm)
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)
