"""Setting a SamplingParams field after construction is checked exactly as the constructor checks
it: a bad value is an error naming the field and the value, and the old value stays."""

import copy
import importlib.util
import math
import os
import pickle
import subprocess
import sys

import pytest

from nanovllm.sampling_params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("max_tokens", 0, ValueError),
        ("max_tokens", -1, ValueError),
        ("max_tokens", 2.0, TypeError),
        ("temperature", math.nan, ValueError),
        ("temperature", -0.5, ValueError),
        ("temperature", math.inf, ValueError),
        ("temperature", "0.7", TypeError),
        ("n", 0, ValueError),
        ("n", True, TypeError),
        ("top_p", 1.5, ValueError),
        ("top_p", 0, ValueError),
        ("top_k", -2, ValueError),
        ("min_p", 2.0, ValueError),
        ("seed", "x", TypeError),
        ("seed", 1.5, TypeError),
        ("stop_token_ids", [-1], ValueError),
        ("stop_token_ids", ["a"], TypeError),
        ("stop", [""], ValueError),
        ("stop", 3, TypeError),
        ("min_tokens", -1, ValueError),
        ("repetition_penalty", 0, ValueError),
        ("presence_penalty", 3.0, ValueError),
        ("frequency_penalty", math.nan, ValueError),
        ("logprobs", -2, ValueError),
        ("ignore_eos", "no", TypeError),
        ("skip_special_tokens", 1, TypeError),
        ("include_stop_str_in_output", None, TypeError),
    ],
)
def test_bad_assignment_is_rejected_and_keeps_the_old_value(field, value, exc):
    params = SamplingParams(stop=["end"], stop_token_ids=[7], seed=3, logprobs=2)
    before = copy.deepcopy(params)
    with pytest.raises(exc) as e:
        setattr(params, field, value)
    message = str(e.value)
    assert f"SamplingParams.{field}" in message and repr(value) in message, message
    assert params == before
    assert getattr(params, field) == getattr(before, field)


def test_bad_assignment_matches_the_constructor_error():
    params = SamplingParams()
    for field, value in [("top_p", 1.5), ("n", 0), ("seed", "x"), ("temperature", math.nan)]:
        with pytest.raises((TypeError, ValueError)) as by_init:
            SamplingParams(**{field: value})
        with pytest.raises(type(by_init.value)) as by_set:
            setattr(params, field, value)
        assert str(by_set.value) == str(by_init.value)


def test_cross_field_rule_holds_after_every_assignment():
    params = SamplingParams(min_tokens=5, max_tokens=10)
    with pytest.raises(ValueError, match="min_tokens") as e:
        params.max_tokens = 4
    assert "4" in str(e.value)
    assert params.max_tokens == 10
    with pytest.raises(ValueError, match="min_tokens"):
        params.min_tokens = 11
    assert params.min_tokens == 5
    params.max_tokens = 5  # equal is allowed
    params.min_tokens = 0
    params.max_tokens = 1
    assert (params.min_tokens, params.max_tokens) == (0, 1)


def test_valid_assignment_is_normalised_like_the_constructor():
    params = SamplingParams()
    params.temperature = 1  # an int becomes a float, as in the constructor
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    params.top_k = -1  # -1 = off, stored as 0
    assert params.top_k == 0
    params.stop = "###"
    assert params.stop == ["###"]
    params.stop = None
    assert params.stop == []
    params.stop_token_ids = (4, 5)
    assert params.stop_token_ids == [4, 5]
    params.top_p = 1
    assert params.top_p == 1.0 and isinstance(params.top_p, float)
    assert params == SamplingParams(temperature=1, top_k=-1, stop=None, stop_token_ids=[4, 5])


def test_derived_flags_follow_assignment():
    params = SamplingParams(temperature=0.7)
    assert not params.is_greedy and not params.has_penalties and not params.has_filters
    params.top_p = 0.9
    assert params.has_filters
    params.temperature = 0
    assert params.is_greedy and not params.has_filters
    params.repetition_penalty = 1.3
    assert params.has_penalties
    params.repetition_penalty = 1.0
    params.frequency_penalty = -0.5
    assert params.has_penalties


def test_unknown_attribute_is_rejected():
    params = SamplingParams()
    with pytest.raises(AttributeError, match="max_token"):
        params.max_token = 3  # a typo of max_tokens
    assert not hasattr(params, "max_token")


def test_for_completion_copy_and_pickle_after_assignment():
    params = SamplingParams(seed=10)
    params.n = 3
    params.max_tokens = 7
    second = params.for_completion(2)
    assert (second.n, second.seed, second.max_tokens) == (1, 12, 7)
    second.top_p = 0.5  # the copy is checked too, and is independent
    assert params.top_p == 1.0
    for clone in (pickle.loads(pickle.dumps(params)), copy.copy(params), copy.deepcopy(params)):
        assert clone == params
        with pytest.raises(ValueError, match="n"):
            clone.n = 0
        clone.max_tokens = 9
        assert clone.max_tokens == 9 and params.max_tokens == 7


def test_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; import nanovllm.sampling_params as m; "
        "p = m.SamplingParams(); p.n = 2"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _example_module():
    spec = importlib.util.spec_from_file_location(
        "nanovllm_example", os.path.join(ROOT, "example.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("value", ["0", "-5"])
def test_example_rejects_a_max_tokens_below_one(value, capsys):
    with pytest.raises(SystemExit):
        _example_module().parse_args(["--max-tokens", value])
    err = capsys.readouterr().err
    assert "--max-tokens" in err and value in err and ">= 1" in err, err


def test_example_accepts_a_positive_max_tokens():
    assert _example_module().parse_args(["--max-tokens", "5"]).max_tokens == 5
