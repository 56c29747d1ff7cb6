"""Stop strings, stop token ids, ``min_tokens`` and EOS (vLLM's conventions: what the text
and the token ids keep).

The references never come from the code under test: greedy loops over Hugging Face transformers
written in ``api_helpers.py`` (penalties, masked ids and stop conditions applied to its logits),
transformers log-softmax for logprobs, the Hugging Face tokenizer for texts and chat templates, and
exact block ids on fresh engines.
"""

from api_helpers import STOP_MAX_TOKENS, STOP_PROMPT, clean, greedy, hf_greedy_loop
from hf_reference import VOCAB_SIZE, assert_greedy_match

# ---- stop strings ---------------------------------------------------------------------------


def test_stop_string_spanning_two_tokens(llm, stop_case):
    c = stop_case
    out, kept = llm.generate(
        [STOP_PROMPT, STOP_PROMPT],
        [
            greedy(STOP_MAX_TOKENS, stop=c.stop),
            greedy(STOP_MAX_TOKENS, stop=[c.stop], include_stop_str_in_output=True),
        ],
        use_tqdm=False,
    )
    what = f"stop={c.stop!r} completed by token {c.k}"
    assert out["token_ids"] == c.tokens[: c.k + 1], what
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", c.stop), what
    assert out["text"] == c.text[: c.at], (
        f"{what}: text {out['text']!r}, expected {c.text[: c.at]!r}"
    )
    assert kept["token_ids"] == c.tokens[: c.k + 1], what
    assert (kept["finish_reason"], kept["stop_reason"]) == ("stop", c.stop), what
    # token k goes on past the stop string: the text is cut right after it
    assert kept["text"] == c.text[: c.at + len(c.stop)] and kept["text"].endswith(c.stop), (
        what,
        kept["text"],
    )


def test_earliest_stop_string_wins(llm, stop_case, tokenizer):
    c = stop_case
    # a stop string inside token k, starting one character after c.stop: both end in token k
    inside = tokenizer.decode([c.tokens[c.k]])[:2]
    assert inside not in tokenizer.decode(c.tokens[: c.k]) and c.text.find(inside) == c.at + 1
    params = [
        greedy(STOP_MAX_TOKENS, stop=[c.stop2]),  # alone it ends at k2
        greedy(STOP_MAX_TOKENS, stop=[c.stop2, c.stop]),  # listed first, but appears later
        greedy(STOP_MAX_TOKENS, stop=[inside, c.stop]),  # same token, listed first, starts later
    ]
    alone, both, same_token = llm.generate([STOP_PROMPT] * 3, params, use_tqdm=False)
    assert alone["token_ids"] == c.tokens[: c.k2 + 1] and alone["stop_reason"] == c.stop2
    for name, out in [("stop2 listed first", both), ("same token", same_token)]:
        assert out["token_ids"] == c.tokens[: c.k + 1], name
        assert (out["finish_reason"], out["stop_reason"]) == ("stop", c.stop), (
            f"{name}: {out['stop_reason']!r}"
        )
        assert out["text"] == c.text[: c.at], f"{name}: {out['text']!r}"


def test_stop_string_in_last_allowed_token(llm, stop_case, tokenizer):
    c = stop_case
    last, before = llm.generate(
        [STOP_PROMPT] * 2, [greedy(c.k + 1, stop=c.stop), greedy(c.k, stop=c.stop)], use_tqdm=False
    )
    assert last["token_ids"] == c.tokens[: c.k + 1]
    assert (last["finish_reason"], last["stop_reason"], last["text"]) == (
        "stop",
        c.stop,
        c.text[: c.at],
    )
    assert before["token_ids"] == c.tokens[: c.k]
    assert (before["finish_reason"], before["stop_reason"]) == ("length", None)
    assert before["text"] == tokenizer.decode(c.tokens[: c.k])


def test_min_tokens_delays_stop_strings(llm, stop_case, tokenizer):
    """Stop strings are checked once more than ``min_tokens`` tokens exist (vLLM)."""
    c = stop_case
    full = tokenizer.decode(c.tokens)
    assert full.count(c.stop) == 1
    checked, skipped = llm.generate(
        [STOP_PROMPT] * 2,
        [
            greedy(STOP_MAX_TOKENS, stop=c.stop, min_tokens=c.k),
            greedy(STOP_MAX_TOKENS, stop=c.stop, min_tokens=c.k + 1),
        ],
        use_tqdm=False,
    )
    assert checked["token_ids"] == c.tokens[: c.k + 1] and checked["stop_reason"] == c.stop
    assert skipped["token_ids"] == c.tokens, (
        "the stop string completed by token min_tokens must not stop"
    )
    assert (skipped["finish_reason"], skipped["stop_reason"], skipped["text"]) == (
        "length",
        None,
        full,
    )


# ---- stop token ids, min_tokens, EOS -----------------------------------------------------------


def test_stop_token_ids(llm, stop_case, ckpt_tied, hf_ref):
    c = stop_case
    j, stop_id = c.j, c.tokens[c.j]
    never = next(t for t in range(VOCAB_SIZE) if t not in c.tokens)
    stopped, unused = llm.generate(
        [STOP_PROMPT] * 2,
        [
            greedy(STOP_MAX_TOKENS, stop_token_ids=[never, stop_id]),
            greedy(8, stop_token_ids=[never]),
        ],
        use_tqdm=False,
    )
    assert stopped["token_ids"] == c.tokens[: j + 1], f"stop id {stop_id} at position {j}"
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop_id)
    assert unused["token_ids"] == c.tokens[:8] and (
        unused["finish_reason"],
        unused["stop_reason"],
    ) == ("length", None)

    # min_tokens past j: the id cannot be produced before min_tokens tokens exist
    model = hf_ref.model(ckpt_tied.path)
    for min_tokens in (j, j + 1, j + 4):  # j + 1: token j is the last suppressed one
        ref = hf_greedy_loop(
            model,
            STOP_PROMPT,
            STOP_MAX_TOKENS,
            suppress=[stop_id],
            min_tokens=min_tokens,
            stop_ids=[stop_id],
        )
        out = llm.generate(
            [STOP_PROMPT],
            greedy(STOP_MAX_TOKENS, stop_token_ids=[stop_id], min_tokens=min_tokens),
            use_tqdm=False,
        )[0]
        what = f"min_tokens={min_tokens}, stop id {stop_id}"
        if min_tokens == j:  # token j is the (min_tokens + 1)-th: allowed, and it stops
            assert ref.tokens == c.tokens[: j + 1], what
        else:
            assert ref.tokens[:j] == c.tokens[:j] and ref.tokens[j] != stop_id, what
            assert stop_id not in ref.tokens[:min_tokens], what
        assert_greedy_match(out["token_ids"], ref, what)
        if out["token_ids"] == ref.tokens:
            expected = ("stop", stop_id) if ref.stopped else ("length", None)
            assert (out["finish_reason"], out["stop_reason"]) == expected, what


def test_eos_finish(eos_case, hf_ref):
    e = eos_case
    ref = hf_ref.greedy(e.path, STOP_PROMPT, 20, stop_on_eos=True)
    assert ref.stopped and ref.tokens == e.tokens[: e.k + 1], "transformers stops there too"
    out, ignoring = e.llm.generate(
        [STOP_PROMPT] * 2, [greedy(20), greedy(20, ignore_eos=True)], use_tqdm=False
    )
    assert out["token_ids"] == ref.tokens, f"eos {e.eos} first produced at position {e.k}"
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", None)
    assert out["outputs"][0]["finish_reason"] == "stop"
    assert ignoring["token_ids"] == e.tokens and ignoring["finish_reason"] == "length"


def test_min_tokens_suppresses_eos(eos_case, hf_ref):
    e = eos_case
    model = hf_ref.model(e.path)
    for min_tokens in (e.k, e.k + 1, e.k + 3):  # k + 1: token k is the last suppressed one
        ref = hf_greedy_loop(
            model, STOP_PROMPT, 20, suppress=[e.eos], min_tokens=min_tokens, stop_ids=[e.eos]
        )
        out = e.llm.generate([STOP_PROMPT], greedy(20, min_tokens=min_tokens), use_tqdm=False)[0]
        what = f"eos {e.eos}, min_tokens={min_tokens}"
        if min_tokens > e.k:
            assert e.eos not in ref.tokens[:min_tokens] and len(ref.tokens) > e.k + 1, what
        assert_greedy_match(out["token_ids"], ref, what)
        if out["token_ids"] == ref.tokens:
            expected = ("stop", None) if ref.stopped else ("length", None)
            assert (out["finish_reason"], out["stop_reason"]) == expected, what


def test_stop_token_text_left_out_like_vllm(llm, stop_case, eos_case, tokenizer):
    """vLLM leaves the text of the token that stopped the completion (EOS or a stop_token_ids
    entry) out of ``text`` unless ``include_stop_str_in_output``; ``token_ids`` keep it."""
    c = stop_case
    j, stop_id = c.j, c.tokens[c.j]
    assert clean(tokenizer.decode([stop_id])), "the stop token must have visible text"
    out, kept = llm.generate(
        [STOP_PROMPT] * 2,
        [
            greedy(STOP_MAX_TOKENS, stop_token_ids=[stop_id]),
            greedy(STOP_MAX_TOKENS, stop_token_ids=[stop_id], include_stop_str_in_output=True),
        ],
        use_tqdm=False,
    )
    assert out["token_ids"] == kept["token_ids"] == c.tokens[: j + 1]
    assert kept["text"] == tokenizer.decode(c.tokens[: j + 1])
    assert out["text"] == tokenizer.decode(c.tokens[:j]), (
        f"stop_token_ids=[{stop_id}] ({tokenizer.decode([stop_id])!r}): text {out['text']!r} "
        "should leave it out"
    )
    e = eos_case
    eos_out = e.llm.generate([STOP_PROMPT], greedy(20), use_tqdm=False)[0]
    assert eos_out["token_ids"][-1] == e.eos
    assert eos_out["text"] == tokenizer.decode(e.tokens[: e.k]), (
        f"eos {e.eos} ({tokenizer.decode([e.eos])!r}): text {eos_out['text']!r} should leave it out"
    )
