"""Helpers of the structured-outputs tests: a tiny random Qwen3 with the whole Qwen3 vocabulary
(so the real tokenizer's every token can be drawn), a mixed batch of constrained requests, and a
check of each completion that does not use the code under test (Python's ``re``, ``json`` and the
``jsonschema`` package)."""

import json
import re

import jsonschema
import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.utils.checkpoint import make_random_checkpoint

EOS_IDS = (
    151643,
    151645,
)  # <|endoftext|>, <|im_end|>: the engine's EOS ids, the grammars' stop tokens
SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["a", "b"]}, "score": {"type": "integer"}},
    "required": ["label", "score"],
}
CHOICES = ["positive", "negative", "neutral"]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
GRAMMAR = 'root ::= "(" [a-c]+ ")"'  # the same language as GRAMMAR_REGEX
GRAMMAR_REGEX = r"\([a-c]+\)"


def make_checkpoint(path: str) -> str:
    make_random_checkpoint(path, dtype=torch.float32, seed=3, std=0.3)
    return path


def make_engine(path: str, **kwargs) -> LLM:
    kwargs = (
        dict(kvcache_block_size=16, num_kvcache_blocks=96, max_model_len=256, max_num_seqs=8)
        | kwargs
    )
    return LLM(path, **kwargs)


def constrained_batch() -> tuple[list[str], list[SamplingParams]]:
    """One request of each kind (choices with n = 2), seeded, at temperature 1. The json_object
    prompt and seed give a completion that ends within max_tokens (most of a random model's JSON
    objects run on in a string)."""
    specs = [
        ("Label this review: good", 1, StructuredOutputsParams(choice=CHOICES), 2),
        ("A part number:", 2, StructuredOutputsParams(regex=REGEX), 1),
        ("JSON please", 3, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), 1),
        (
            "A schema as text",
            4,
            StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True),
            1,
        ),
        ("paren", 5, StructuredOutputsParams(grammar=GRAMMAR), 1),
        ("obj", 2, StructuredOutputsParams(json_object=True, disable_any_whitespace=True), 1),
    ]
    prompts = [prompt for prompt, *_ in specs]
    params = [
        SamplingParams(temperature=1.0, max_tokens=150, seed=seed, n=n, structured_outputs=so)
        for _, seed, so, n in specs
    ]
    return prompts, params


def check_completion(so: StructuredOutputsParams, text: str) -> None:
    """``text`` is in the language of ``so`` (JSON with compact separators when
    ``disable_any_whitespace``)."""
    if so.choice is not None:
        assert text in so.choice, text
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), text
    elif so.grammar is not None:
        assert so.grammar == GRAMMAR and re.fullmatch(GRAMMAR_REGEX, text), text
    else:
        value = json.loads(text)
        if so.json_object:
            assert isinstance(value, dict), text
        else:
            jsonschema.validate(value, SCHEMA if isinstance(so.json, str) else so.json)
        if so.disable_any_whitespace:
            assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False), text


def check_output(output: dict, params: SamplingParams, tokenizer) -> None:
    """Every completion of a constrained request matches its grammar and ends at the grammar's end:
    "stop" on an EOS id, which stays in ``token_ids`` but not in the text."""
    assert len(output["outputs"]) == params.n
    for c in output["outputs"]:
        assert (c["finish_reason"], c["stop_reason"]) == ("stop", None), c
        assert c["token_ids"][-1] in EOS_IDS, c
        assert c["text"] == tokenizer.decode(c["token_ids"][:-1], skip_special_tokens=True), c
        check_completion(params.structured_outputs, c["text"])
