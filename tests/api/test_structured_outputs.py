"""Structured outputs end to end on a tiny random model with the real Qwen3 tokenizer: at
temperature 1 every constrained completion is in its grammar's language and ends with "stop" at
the grammar's end, with async scheduling on and off, beside unconstrained requests (whose seeded
tokens are those they get alone), under preemption, streamed and aborted."""

import os
import pickle
import subprocess
import sys

import pytest
from structured_helpers import (
    CHOICES,
    EOS_IDS,
    SCHEMA,
    check_output,
    constrained_batch,
    make_checkpoint,
    make_engine,
)
from transformers import AutoTokenizer

from nanovllm import SamplingParams, StructuredOutputsParams
from nanovllm.features.structured_outputs.processor import GrammarProcessor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FREE_PROMPTS = ["An unconstrained prompt", "Another one, a little longer than the first"]


def free_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, max_tokens=12, seed=40 + i, ignore_eos=True)
        for i in range(2)
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3-structured")))


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(model, request):
    engine = make_engine(model, async_scheduling=request.param)
    yield engine
    engine.exit()


def test_every_completion_matches_its_grammar_beside_unconstrained_requests(llm, tokenizer):
    alone = llm.generate(FREE_PROMPTS, free_params(), use_tqdm=False)
    prompts, params = constrained_batch()
    outputs = llm.generate(FREE_PROMPTS + prompts, free_params() + params, use_tqdm=False)
    for output, sp in zip(outputs[2:], params):
        check_output(output, sp, tokenizer)
    for output, reference in zip(outputs[:2], alone):
        assert output["token_ids"] == reference["token_ids"] and output["finish_reason"] == "length"
    assert llm.get_stats()["num_requests_running"] == 0


def test_the_grammar_ends_the_completion_even_with_ignore_eos(llm, tokenizer):
    sp = SamplingParams(
        temperature=1.0,
        max_tokens=50,
        seed=7,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )
    check_output(llm.generate(["Label:"], sp, use_tqdm=False)[0], sp, tokenizer)


def test_max_tokens_still_ends_a_constrained_completion(llm):
    so = StructuredOutputsParams(regex=r"[a-z]{40}")
    out = llm.generate(
        ["letters"],
        SamplingParams(temperature=1.0, max_tokens=3, seed=1, structured_outputs=so),
        use_tqdm=False,
    )[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 3
    assert not set(out["token_ids"]) & set(EOS_IDS)
    text = out["text"]
    assert 3 <= len(text) < 40 and text.isascii() and text.isalpha() and text.islower(), text


def test_stream_gives_the_constrained_completion_of_generate(llm, tokenizer):
    prompts, params = constrained_batch()
    prompts, params = prompts[:3], params[:3]
    expected = llm.generate(prompts, params, use_tqdm=False)
    got = {}
    for inc in llm.stream(prompts, params):
        entry = got.setdefault((inc["index"], inc["completion"]), {"token_ids": [], "text": ""})
        entry["token_ids"] += inc["token_ids"]
        entry["text"] += inc["text"]
        if inc["finished"]:
            entry["finish_reason"] = inc["finish_reason"]
    for i, (output, sp) in enumerate(zip(expected, params)):
        check_output(output, sp, tokenizer)
        for c, completion in enumerate(output["outputs"]):
            assert got[i, c] == {k: completion[k] for k in ("token_ids", "text", "finish_reason")}


def test_abort_frees_the_matchers_and_the_engine_serves_on(llm, tokenizer):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    request_id = llm.add_request(
        "JSON please",
        SamplingParams(temperature=1.0, max_tokens=150, seed=3, n=2, structured_outputs=so),
    )
    seqs = list(llm.core.requests[request_id])
    assert all(isinstance(seq.processors[-1], GrammarProcessor) for seq in seqs)
    llm.step()
    llm.step()
    assert llm.abort_request(request_id)
    assert all(seq.processors == [] and seq.finish_reason == "abort" for seq in seqs)
    while not llm.is_finished():
        llm.step()
    prompts, params = constrained_batch()
    for output, sp in zip(llm.generate(prompts, params, use_tqdm=False), params):
        check_output(output, sp, tokenizer)


def test_preempted_constrained_sequences_stay_in_their_grammar(model, tokenizer):
    """A cache of 12 blocks of 16 tokens cannot hold these four at once: the newest are preempted
    and recomputed, their matchers having taken exactly their tokens."""
    engine = make_engine(model, num_kvcache_blocks=12)
    try:
        so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        params = [
            SamplingParams(temperature=1.0, max_tokens=150, seed=7 + i, structured_outputs=so)
            for i in range(4)
        ]
        prompts = ["JSON please, " + "the record of an item " * (2 + i) for i in range(4)]
        for output, sp in zip(engine.generate(prompts, params, use_tqdm=False), params):
            check_output(output, sp, tokenizer)
        assert engine.get_stats()["num_preemptions"] > 0
    finally:
        engine.exit()


# ---- bad specs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"json": {"type": "nope"}}, ValueError, ["StructuredOutputsParams.json", "nope"]),
        ({"json": "{not json"}, ValueError, ["StructuredOutputsParams.json", "not valid JSON"]),
        ({"json": ["a"]}, TypeError, ["StructuredOutputsParams.json", "['a']"]),
        ({"regex": "a(b"}, ValueError, ["StructuredOutputsParams.regex", "parenthesis"]),
        ({"regex": 3}, TypeError, ["StructuredOutputsParams.regex", "3"]),
        (
            {"grammar": "root ::= missing"},
            ValueError,
            ["StructuredOutputsParams.grammar", "missing"],
        ),
        ({"grammar": ""}, ValueError, ["StructuredOutputsParams.grammar", "empty"]),
        ({"choice": []}, TypeError, ["StructuredOutputsParams.choice", "[]"]),
        ({"choice": "yes"}, TypeError, ["StructuredOutputsParams.choice", "'yes'"]),
        ({"choice": ["a", 1]}, TypeError, ["StructuredOutputsParams.choice"]),
        ({"choice": ["a", ""]}, ValueError, ["StructuredOutputsParams.choice", "empty"]),
        ({"json_object": "yes"}, TypeError, ["StructuredOutputsParams.json_object", "'yes'"]),
        (
            {"choice": ["a"], "disable_any_whitespace": 1},
            TypeError,
            ["disable_any_whitespace", "1"],
        ),
        ({}, ValueError, ["exactly one of json, regex, choice, grammar, json_object", "none"]),
        ({"json_object": False}, ValueError, ["exactly one of", "none"]),
        ({"regex": "a", "choice": ["a"]}, ValueError, ["exactly one of", "regex, choice"]),
    ],
)
def test_bad_specs_are_errors_naming_the_field(kwargs, error, words):
    with pytest.raises(error) as e:
        StructuredOutputsParams(**kwargs)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_sampling_params_check_structured_outputs_on_construction_and_assignment():
    with pytest.raises(TypeError, match=r"SamplingParams.structured_outputs .*'\{\}'"):
        SamplingParams(structured_outputs="{}")
    so = StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(
        ValueError, match="SamplingParams.min_tokens must be 0 with structured_outputs"
    ):
        SamplingParams(min_tokens=2, structured_outputs=so)
    sp = SamplingParams(structured_outputs=so)
    for value, error in [
        ({"regex": "x"}, TypeError),
        (StructuredOutputsParams(choice=["x"]), None),
    ]:
        if error is None:
            sp.structured_outputs = value
            assert sp.structured_outputs.choice == ["x"]
        else:
            with pytest.raises(error, match="SamplingParams.structured_outputs"):
                sp.structured_outputs = value
            assert sp.structured_outputs is so
    with pytest.raises(ValueError, match="min_tokens"):
        sp.min_tokens = 1
    assert sp.min_tokens == 0
    with pytest.raises(AttributeError):  # a checked spec stays checked
        so.regex = "("


def test_bad_requests_queue_nothing_and_the_engine_serves_on(llm, tokenizer):
    _, params = constrained_batch()
    with pytest.raises(TypeError, match=r"prompts\[1\]: sampling_params must be a SamplingParams"):
        llm.generate(["a", "b"], [params[0], StructuredOutputsParams(regex="x")], use_tqdm=False)
    with pytest.raises(ValueError, match="StructuredOutputsParams.regex"):
        llm.generate(
            ["a"],
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="[")),
            use_tqdm=False,
        )
    assert llm.is_finished() and not llm.core.requests
    check_output(llm.generate(["Label:"], params[0], use_tqdm=False)[0], params[0], tokenizer)


def test_params_pickle_without_a_compiled_grammar_and_plain_use_imports_no_xgrammar():
    sp = SamplingParams(
        n=2, structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    )
    copy = pickle.loads(pickle.dumps(sp))
    assert copy == sp and copy.structured_outputs.key == sp.structured_outputs.key
    assert len(pickle.dumps(sp)) < 2000  # the spec only
    code = (
        "import sys\n"
        "from nanovllm import SamplingParams, StructuredOutputsParams\n"
        "import nanovllm.engine.core, nanovllm.engine.step\n"
        "SamplingParams(max_tokens=3)\n"
        "print('xgrammar' in sys.modules, 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.stdout.split() == ["False", "False"], result.stdout + result.stderr
