"""``stream``: increments that add up to ``generate``'s outputs, never a split character,
and a break out of the loop aborting its requests.

The references never come from the code under test: greedy loops over Hugging Face transformers
written in ``api_helpers.py`` (penalties, masked ids and stop conditions applied to its logits),
transformers log-softmax for logprobs, the Hugging Face tokenizer for texts and chat templates, and
exact block ids on fresh engines.
"""

from collections import defaultdict

from api_helpers import (
    STOP_MAX_TOKENS,
    STOP_PROMPT,
    assert_idle,
    assert_serves_correctly,
    greedy,
    run_to_completion,
)
from hf_reference import VOCAB_SIZE, assert_greedy_match, random_prompts

from nanovllm import SamplingParams

# ---- stream ----------------------------------------------------------------------------------


def collect_stream(llm, prompts, params) -> dict[tuple[int, int], list[dict]]:
    increments = defaultdict(list)
    for inc in llm.stream(prompts, params):
        increments[(inc["index"], inc["completion"])].append(inc)
    return increments


def check_increments(
    increments: list[dict], expected: dict, reference_text: str, what: str
) -> None:
    """The increments of one completion add up to ``expected`` (a generate completion), only the
    last is final, and no text handed out before it ends inside a character: a running increment
    may end in U+FFFD only where the tokenizer's decoding of all the completion's tokens
    (``reference_text``) has a replacement character of its own (an invalid byte), never the
    first bytes of a character still coming."""
    *running, final = increments
    assert all(not inc["finished"] for inc in running) and final["finished"], what
    assert (final["finish_reason"], final["stop_reason"]) == (
        expected["finish_reason"],
        expected["stop_reason"],
    ), what
    assert [t for inc in increments for t in inc["token_ids"]] == expected["token_ids"], what
    assert "".join(inc["text"] for inc in increments) == expected["text"], what
    sent = 0
    for i, inc in enumerate(running):
        sent += len(inc["text"])
        if inc["text"].endswith("\ufffd"):
            assert reference_text[sent - 1] == "\ufffd", (
                f"{what}: increment {i} ends inside a character: {inc['text']!r}"
            )
    if expected["logprobs"] is None:
        assert all(inc["logprobs"] is None for inc in increments), what
    else:
        assert [e for inc in increments for e in inc["logprobs"]] == expected["logprobs"], what


def test_stream_adds_up_to_generate(llm, tokenizer, stop_case):
    prompts = random_prompts(70, [9, 30]) + [STOP_PROMPT]
    params = [
        SamplingParams(temperature=1.0, seed=21, n=2, stop=["es", "\n"], logprobs=2, max_tokens=24),
        SamplingParams(temperature=0.9, seed=22, max_tokens=16),
        greedy(STOP_MAX_TOKENS, stop=[stop_case.stop]),  # spans two tokens
    ]
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert expected[2]["text"] == stop_case.text[: stop_case.at]
    increments = collect_stream(llm, prompts, params)
    assert sorted(increments) == [(0, 0), (0, 1), (1, 0), (2, 0)]
    for (index, completion), incs in increments.items():
        out = expected[index]["outputs"][completion]
        check_increments(
            incs,
            out,
            tokenizer.decode(out["token_ids"]),
            f"prompts[{index}] completion {completion}",
        )
    reasons = [c["stop_reason"] for o in expected for c in o["outputs"]]
    assert any(isinstance(r, str) for r in reasons) and None in reasons, (
        f"want both endings: {reasons}"
    )
    for o in expected:
        for c in o["outputs"]:
            if c["finish_reason"] == "length":
                assert c["text"] == tokenizer.decode(c["token_ids"])
    assert_idle(llm)


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """``text`` as one byte-level token per UTF-8 byte (GPT-2's byte alphabet, which Qwen's first
    256 ids hold): its multi-byte characters are split over 2 to 4 tokens."""
    alphabet = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars = {b: chr(b) for b in alphabet}
    chars |= {b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in chars)}
    ids = [tokenizer.convert_tokens_to_ids(chars[b]) for b in text.encode()]
    assert max(ids) < VOCAB_SIZE and tokenizer.decode(ids) == text
    return ids


def script_tokens(llm, monkeypatch, scripts: dict[tuple[int, ...], list[int]]) -> None:
    """Fake sampling, as vLLM's core tests do: a sequence whose prompt is a key of ``scripts`` gets
    the script's next token instead of the sampled one when the host learns the step's tokens
    (the model still runs, on the sampled ones). The core launches a step (``executor.run``), then
    advances its sequences (``scheduler.advance``): the second sees which sequences the first
    ran."""
    core = llm.core
    real_run, real_advance = core.executor.run, core.scheduler.advance
    launched = []

    def run(step):
        output = real_run(step)
        launched.append(output)
        return output

    def advance(seqs):
        output = launched.pop()
        scripted = [
            (i, script[seq.num_completion_tokens])
            for i, seq in enumerate(seqs)
            if (script := scripts.get(tuple(seq.prompt_token_ids))) is not None
        ]
        real_result = output.result

        def result():
            token_ids, *rest = real_result()
            for i, token_id in scripted:
                token_ids[i] = token_id
            return token_ids, *rest

        output.result = result
        return real_advance(seqs)

    monkeypatch.setattr(core.executor, "run", run)
    monkeypatch.setattr(core.scheduler, "advance", advance)


MULTIBYTE_TEXT = "Café → 東京 🎉 done!"


def test_stream_never_splits_a_character(llm, tokenizer, monkeypatch):
    script = byte_token_ids(tokenizer, MULTIBYTE_TEXT)
    data = MULTIBYTE_TEXT.encode()
    prompts = random_prompts(73, [6, 7, 8, 9])
    script_tokens(llm, monkeypatch, {tuple(p): script for p in prompts})
    n = len(script)
    params = [
        greedy(n),
        greedy(n, stop="🎉"),
        greedy(n, stop=["x", "京 🎉"]),  # spans 6 tokens: the stream must hold "京 " back
        greedy(n, stop=["京 🎉", "x"], include_stop_str_in_output=True),
    ]
    plain, stopped, long_stop, kept = expected = llm.generate(prompts, params, use_tqdm=False)
    assert plain["token_ids"] == script and plain["text"] == MULTIBYTE_TEXT
    party = len("Café → 東京 🎉".encode())  # the emoji's 4th byte completes the stop strings
    for out in (stopped, long_stop, kept):
        assert out["token_ids"] == script[:party] and out["finish_reason"] == "stop"
    assert (stopped["text"], stopped["stop_reason"]) == ("Café → 東京 ", "🎉")
    assert (long_stop["text"], long_stop["stop_reason"]) == ("Café → 東", "京 🎉")
    assert (kept["text"], kept["stop_reason"]) == ("Café → 東京 🎉", "京 🎉")

    increments = collect_stream(llm, prompts, params)
    for index, out in enumerate(expected):
        incs = increments[(index, 0)]
        check_increments(incs, out, tokenizer.decode(out["token_ids"]), f"prompts[{index}]")
        assert all("\ufffd" not in inc["text"] for inc in incs), (
            f"prompts[{index}]: {[i['text'] for i in incs]}"
        )
    # without stop strings, each character is handed out in the step that completes it
    sent_text, sent_tokens = "", 0
    for inc in increments[(0, 0)]:
        sent_text += inc["text"]
        sent_tokens += len(inc["token_ids"])
        assert sent_text == data[:sent_tokens].decode("utf-8", errors="ignore"), (
            sent_tokens,
            sent_text,
        )


def test_stream_break_aborts_its_requests(llm, ckpt_tied, hf_ref):
    queued = random_prompts(72, [13])[0]
    queued_id = llm.add_request(queued, greedy(30))
    seen = 0
    for _ in llm.stream(
        random_prompts(71, [5, 20, 35]), SamplingParams(temperature=0.8, max_tokens=40, n=2)
    ):
        seen += 1
        if seen == 5:
            break
    assert seen == 5
    # the add_request's request goes on; the stream's are gone
    assert [s.seq_id for s in llm.core.scheduler.running] + [
        s.seq_id for s in llm.core.scheduler.waiting
    ] == [queued_id]
    finished = run_to_completion(llm)
    assert list(finished) == [queued_id]
    assert_greedy_match(
        finished[queued_id], hf_ref.greedy(ckpt_tied.path, queued, 30), "queued request"
    )
    assert_idle(llm)

    stream = llm.stream([queued], greedy(30))
    next(stream)
    stream.close()
    assert_idle(llm)
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)
