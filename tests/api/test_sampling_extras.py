"""vLLM's logit_bias, allowed_token_ids, bad_words, detokenize, extra_args, clone() and
whole-vocabulary logprobs with ranks, against a plain greedy run's logprobs=-1 (every token's
log-probability)."""

import pytest
from api_helpers import assert_idle, greedy
from hf_reference import VOCAB_SIZE, random_prompts

from nanovllm import SamplingParams

PROMPT = random_prompts(90, [14])[0]


def full(llm, max_tokens: int, **kwargs):
    return llm.generate([PROMPT], greedy(max_tokens, logprobs=-1, **kwargs), use_tqdm=False)[0]


def best(entry: dict, allowed) -> int:
    return max(allowed, key=lambda t: entry[t].logprob)


def test_whole_vocabulary_logprobs_and_ranks(llm):
    out = full(llm, 4)
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        order = sorted(entry, key=lambda t: -entry[t].logprob)
        assert len(entry) == VOCAB_SIZE and order[0] == token
        assert list(entry) == order  # the chosen token first, then the rest by rank
        assert [entry[t].rank for t in order] == list(range(1, VOCAB_SIZE + 1))


def test_rank_of_a_token_outside_the_top(llm):
    """A drawn token outside the top 2 comes first, with its rank in the whole vocabulary."""
    hot = dict(temperature=5.0, seed=7, max_tokens=10)
    got = llm.generate([PROMPT], SamplingParams(**hot, logprobs=2), use_tqdm=False)[0]
    ref = llm.generate([PROMPT], SamplingParams(**hot, logprobs=-1), use_tqdm=False)[0]
    got, ref = got.outputs[0], ref.outputs[0]
    assert got.token_ids == ref.token_ids
    outside = 0
    for token, entry, whole in zip(got.token_ids, got.logprobs, ref.logprobs):
        top = sorted(whole, key=lambda t: -whole[t].logprob)[:2]
        assert list(entry) == [token] + [t for t in top if t != token]
        rank = sum(v.logprob >= whole[token].logprob for v in whole.values())
        assert entry[token].rank == whole[token].rank == rank
        for r, t in enumerate(top, 1):
            assert entry[t].rank == r and entry[t].logprob == pytest.approx(whole[t].logprob)
        outside += rank > 2
    assert outside > 0, "some drawn token should be outside the top 2"


def test_allowed_token_ids_picks_the_best_allowed(llm):
    plain = full(llm, 1).outputs[0]
    entry = plain.logprobs[0]
    allowed = sorted(entry, key=lambda t: -entry[t].logprob)[5:9][::-1]  # 6th..9th most likely
    out = llm.generate([PROMPT], greedy(1, allowed_token_ids=allowed), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [best(entry, allowed)]
    assert out.outputs[0].token_ids[0] != plain.token_ids[0]
    seq = llm.generate([PROMPT], greedy(6, allowed_token_ids=allowed), use_tqdm=False)[0]
    assert set(seq.outputs[0].token_ids) <= set(allowed)


def test_logit_bias(llm):
    plain = full(llm, 1).outputs[0]
    entry = plain.logprobs[0]
    last = min(entry, key=lambda t: entry[t].logprob)  # the least likely token
    out = llm.generate([PROMPT], greedy(1, logit_bias={last: 100.0}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [last]
    # a bias that changes the order by an exact amount: the second token by the gap and a bit
    first, second = sorted(entry, key=lambda t: -entry[t].logprob)[:2]
    gap = entry[first].logprob - entry[second].logprob
    for bias, want in ((gap - 1e-3, first), (gap + 1e-3, second)):
        sp = greedy(1, logit_bias={second: bias}, logprobs=2)
        got = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == [want], bias
        # logprobs are the raw model's (vLLM's default): the bias does not show in them
        assert got.logprobs[0][second].logprob == pytest.approx(entry[second].logprob, abs=1e-5)


def test_bad_words(llm, tokenizer):
    ref = full(llm, 12).outputs[0]
    tokens = ref.token_ids
    # a one-token word: banned everywhere; greedy takes the best other token there
    word = tokenizer.decode([tokens[0]])
    ids = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    if len(ids) == 1 and ids[0] < VOCAB_SIZE and word.strip():
        out = llm.generate([PROMPT], greedy(1, bad_words=[word]), use_tqdm=False)[0].outputs[0]
        entry = ref.logprobs[0]
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        banned = {ids[0]} | ({spaced[0]} if len(spaced) == 1 else set())
        assert out.token_ids == [best(entry, [t for t in entry if t not in banned])]
    # a two-token word: its last token is banned only right after its first
    for k in range(1, len(tokens)):
        pair = tokens[k - 1 : k + 1]
        text = tokenizer.decode(pair)
        if tokenizer.encode(text, add_special_tokens=False) == pair and text.strip() == text:
            break
    else:
        pytest.skip("no two-token word in the continuation tokenizes back to itself")
    out = llm.generate([PROMPT], greedy(12, bad_words=[text], logprobs=-1), use_tqdm=False)
    got = out[0].outputs[0]
    assert got.token_ids[:k] == tokens[:k]
    entry = ref.logprobs[k]
    assert got.token_ids[k] == best(entry, [t for t in entry if t != pair[1]])
    for j in range(1, len(got.token_ids)):
        assert got.token_ids[j - 1 : j + 1] != pair


def test_detokenize_false(llm):
    out = llm.generate([PROMPT], greedy(5, detokenize=False, logprobs=1), use_tqdm=False)[0]
    ref = llm.generate([PROMPT], greedy(5), use_tqdm=False)[0]
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert all(v.decoded_token is None for e in out.outputs[0].logprobs for v in e.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])
    streamed = list(llm.stream([PROMPT], greedy(5, detokenize=False)))
    assert "".join(inc["text"] for inc in streamed) == ""


def test_prompt_logprob_ranks(llm):
    out = llm.generate([PROMPT], greedy(1, prompt_logprobs=-1), use_tqdm=False)[0]
    some = llm.generate([PROMPT], greedy(1, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and some.prompt_logprobs[0] is None
    outside = 0
    for token, whole, entry in zip(PROMPT[1:], out.prompt_logprobs[1:], some.prompt_logprobs[1:]):
        assert len(whole) == VOCAB_SIZE and list(entry)[0] == token
        rank = sum(v.logprob >= whole[token].logprob for v in whole.values())
        assert entry[token].rank == whole[token].rank == rank
        outside += rank > 1
    assert outside > 0


@pytest.mark.parametrize(
    "field, value, error, words",
    [
        ("logit_bias", [1], TypeError, "a dict"),
        ("logit_bias", {1: float("nan")}, ValueError, "finite"),
        ("logit_bias", {-1: 1.0}, ValueError, ">= 0"),
        ("allowed_token_ids", [], ValueError, "non-empty"),
        ("allowed_token_ids", [1, "2"], TypeError, "list of token ids"),
        ("bad_words", "word", TypeError, "a list of str"),
        ("bad_words", [" "], ValueError, "non-blank"),
        ("detokenize", 1, TypeError, "bool"),
        ("extra_args", [1], TypeError, "a dict or None"),
    ],
)
def test_bad_values(field, value, error, words):
    with pytest.raises(error) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value) and words in str(e.value), str(e.value)
    sp = SamplingParams()
    with pytest.raises(error):
        setattr(sp, field, value)
    assert getattr(sp, field) == SamplingParams().__dict__[field]


def test_ids_outside_the_vocabulary(llm):
    for field, value in (
        ("logit_bias", {VOCAB_SIZE: 1.0}),
        ("allowed_token_ids", [3, VOCAB_SIZE + 5]),
    ):
        with pytest.raises(ValueError) as e:
            llm.generate([PROMPT], greedy(2, **{field: value}), use_tqdm=False)
        assert field in str(e.value) and str(VOCAB_SIZE) in str(e.value), str(e.value)
    assert_idle(llm)


def test_clone_and_extra_args():
    sp = SamplingParams(logit_bias={3: 1.0}, extra_args={"a": [1]}, bad_words=["x"])
    copy = sp.clone()
    assert copy == sp and copy is not sp and copy.extra_args is not sp.extra_args
    copy.extra_args["a"].append(2)
    assert sp.extra_args == {"a": [1]}
