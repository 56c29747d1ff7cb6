"""Structured outputs across processes: two data-parallel replicas (the params pickle to each, and
each compiles and matches its own grammars) give the tokens one engine gives; with two
tensor-parallel ranks (the mask applied on rank 0, where sampling happens) every completion is in
its grammar's language."""

import multiprocessing

import pytest
from structured_helpers import check_output, constrained_batch, make_checkpoint, make_engine
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-structured")))


def completions(outputs: list[dict]) -> list:
    return [
        [(c["token_ids"], c["text"], c["finish_reason"]) for c in o["outputs"]] for o in outputs
    ]


def test_data_parallel_replicas_give_one_engines_constrained_tokens(model):
    prompts, params = constrained_batch()
    one = make_engine(model)
    try:
        expected = one.generate(prompts, params, use_tqdm=False)
    finally:
        one.exit()
    two = make_engine(model, data_parallel_size=2)
    try:
        got = two.generate(prompts, params, use_tqdm=False)
        assert all(r["generation_tokens"] > 0 for r in two.get_stats()["replicas"]), (
            "both replicas should serve"
        )
    finally:
        two.exit()
    assert not multiprocessing.active_children()
    tokenizer = AutoTokenizer.from_pretrained(model)
    for output, sp in zip(expected, params):
        check_output(output, sp, tokenizer)
    assert completions(got) == completions(expected)


def test_tensor_parallel_constrained_completions_match_their_grammars(model):
    prompts, params = constrained_batch()
    with make_engine(model, tensor_parallel_size=2) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(model)
    for output, sp in zip(outputs, params):
        check_output(output, sp, tokenizer)
