"""The offline API beyond plain greedy ``generate`` (vLLM's conventions): stop strings and stop
token ids, ``min_tokens`` and EOS, penalties and logprobs, ``n`` completions sharing their prompt's
blocks, seeded sampling, ``chat``, ``stream``, ``abort_request``, interrupted calls, ``get_stats``,
the model folder's default sampling params, prompts as arrays and tensors, and every invalid
``SamplingParams`` value.

The references never come from the code under test: greedy loops over Hugging Face transformers
written here (penalties, masked ids and stop conditions applied to its logits), transformers
log-softmax for logprobs, the Hugging Face tokenizer for texts and chat templates, and exact block
ids on fresh engines.
"""
import json
import math
import os
import shutil
import signal
from collections import Counter, defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from hf_reference import BLOCK_SIZE, TIE_GAP, VOCAB_SIZE, GreedyRef, assert_greedy_match, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import make_random_checkpoint

MAX_MODEL_LEN = 256
STOP_PROMPT = random_prompts(102, [12])[0]  # its greedy continuation has clean text to cut
STOP_MAX_TOKENS = 24


def make_llm(path: str, **kwargs) -> LLM:
    kwargs = dict(kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=96, max_model_len=MAX_MODEL_LEN) | kwargs
    return LLM(path, **kwargs)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def copy_checkpoint(src: str, dst: str, config_changes: dict | None = None, generation_config="keep") -> str:
    """A copy of checkpoint ``src`` (same weights) with ``config_changes`` in config.json and
    ``generation_config`` (a dict, None = no file, "keep" = the source's) as generation_config.json."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    if config_changes:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        config.update(config_changes)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    gen_file = os.path.join(dst, "generation_config.json")
    if generation_config is None:
        os.remove(gen_file)
    elif generation_config != "keep":
        with open(gen_file, "w") as f:
            json.dump(generation_config, f)
    return dst


# ---- references and checks -------------------------------------------------------------------


def hf_greedy_loop(model, prompt: list[int], max_tokens: int, *, adjust=None, suppress=(), min_tokens: int = 0,
                   stop_ids=(), until_not=None) -> GreedyRef:
    """A transformers greedy loop (full recompute each step) with vLLM's controls applied to its
    float64 logits: ``suppress`` ids masked to -inf while fewer than ``min_tokens`` tokens exist,
    then ``adjust(logits, prompt, output)`` (penalties, in place); ends after a token of
    ``stop_ids`` once ``min_tokens`` tokens exist (``stopped`` then), or (``until_not``, a token
    list) at the first token that differs from it."""
    ids, tokens, gaps, stopped = list(prompt), [], [], False
    with torch.no_grad():
        for step in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            if step < min_tokens and suppress:
                logits[list(suppress)] = -math.inf
            if adjust is not None:
                adjust(logits, prompt, tokens)
            top = logits.topk(2).values
            token = int(logits.argmax())
            tokens.append(token)
            gaps.append(float(top[0] - top[1]))
            ids.append(token)
            if step >= min_tokens and token in stop_ids:
                stopped = True
                break
            if until_not is not None and tokens != until_not[: len(tokens)]:
                break
    return GreedyRef(tokens, gaps, stopped)


def repetition_penalty(penalty: float, scope: str = "prompt+output"):
    """vLLM's repetition penalty over the tokens of prompt and output ("output": a wrong scope, to
    show the test tells them apart)."""

    def adjust(logits, prompt, output):
        seen = sorted(set(output) | (set(prompt) if scope == "prompt+output" else set()))
        if seen:
            x = logits[seen]
            logits[seen] = torch.where(x > 0, x / penalty, x * penalty)

    return adjust


def count_penalties(presence: float, frequency: float, scope: str = "output"):
    """``logits -= frequency * count + presence * (count > 0)`` over the output's token counts
    ("prompt+output": a wrong scope)."""

    def adjust(logits, prompt, output):
        counted = output if scope == "output" else list(prompt) + output
        for token, count in Counter(counted).items():
            logits[token] -= frequency * count + presence

    return adjust


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits at each completion position: [len(completion), vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)], dim=-1).double()


def clean(text: str) -> bool:
    """Printable text, no replacement character: its decoding does not depend on its neighbours."""
    return bool(text) and "\ufffd" not in text and text.isprintable()


def boundary_stop(tokenizer, tokens: list[int], first: int) -> tuple[int, str]:
    """The first ``k >= first`` whose token and the one before it decode to clean text, token ``k``
    to two characters or more; returns ``k`` and the stop string made of the last character of
    token ``k - 1`` and the first of token ``k``, which the text of ``tokens[:k]`` does not hold."""
    for k in range(first, len(tokens)):
        before, text = tokenizer.decode([tokens[k - 1]]), tokenizer.decode([tokens[k]])
        if clean(before) and clean(text) and len(text) >= 2:
            stop = before[-1] + text[0]
            if stop not in tokenizer.decode(tokens[:k]):
                return k, stop
    raise AssertionError(f"no stop string spanning two clean tokens from token {first} on: {tokens}")


def first_new_token(ref: GreedyRef, start: int = 3) -> int:
    """The first position >= ``start`` whose token does not occur before it, with no near-tie up to there."""
    for k in range(start, len(ref.tokens)):
        if ref.tokens[k] not in ref.tokens[:k] and min(ref.gaps[: k + 1]) > 100 * TIE_GAP:
            return k
    raise AssertionError(f"no usable token in {ref.tokens}")


def run_to_completion(llm) -> dict[int, list[int]]:
    finished = {}
    for _ in range(1000):
        if llm.is_finished():
            return finished
        outputs, _ = llm.step()
        finished.update(outputs)
    raise AssertionError("the engine did not finish")


def assert_idle(llm) -> None:
    """Nothing running or waiting, every block free."""
    stats = llm.get_stats()
    idle = (stats["num_requests_running"], stats["num_requests_waiting"], stats["kv_cache_usage"])
    assert idle == (0, 0, 0.0), f"not idle: {stats}"
    assert llm.is_finished()
    bm = llm.scheduler.block_manager
    assert not bm.used_block_ids and all(b.ref_count == 0 for b in bm.blocks), "blocks still held"


def assert_serves_correctly(llm, path, hf_ref, seed=7) -> None:
    """A greedy batch gives the transformers tokens and leaves the engine idle."""
    prompts = random_prompts(seed, [3, 20, 41])
    outputs = llm.generate(prompts, greedy(6), use_tqdm=False)
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert out["prompt_token_ids"] == prompt
        assert_greedy_match(out["token_ids"], hf_ref.greedy(path, prompt, 6), f"prompts[{i}]")
    assert_idle(llm)


# ---- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(ckpt_tied):
    engine = make_llm(ckpt_tied.path)
    yield engine
    engine.exit()


@pytest.fixture
def llm(engine):
    """The module's engine; what a failed test leaves queued is run off, not left to the next test."""
    yield engine
    run_to_completion(engine)


@pytest.fixture(scope="module")
def tokenizer(ckpt_tied):
    """The reference tokenizer: loaded here, not the engine's."""
    return AutoTokenizer.from_pretrained(ckpt_tied.path)


@pytest.fixture(scope="module")
def stop_case(ckpt_tied, hf_ref, tokenizer):
    """STOP_PROMPT's greedy continuation, a stop string spanning tokens ``k - 1`` and ``k``, a
    second one spanning ``k2 - 1`` and ``k2`` (later), and ``j``, the first position (from 3)
    whose token does not occur before it (a stop token id)."""
    ref = hf_ref.greedy(ckpt_tied.path, STOP_PROMPT, STOP_MAX_TOKENS)
    assert min(ref.gaps) > 100 * TIE_GAP, "the reference continuation must have no near-tie"
    k, stop = boundary_stop(tokenizer, ref.tokens, first=2)
    k2, stop2 = boundary_stop(tokenizer, ref.tokens, first=k + 1)
    text = tokenizer.decode(ref.tokens[: k + 1])
    at = text.find(stop)
    # the stop string starts in an earlier token and ends in token k
    assert at < len(tokenizer.decode(ref.tokens[:k])) < at + len(stop) < len(text), (text, stop)
    return SimpleNamespace(tokens=ref.tokens, k=k, stop=stop, k2=k2, stop2=stop2, text=text, at=at,
                           j=first_new_token(ref))


@pytest.fixture(scope="module")
def eos_case(ckpt_tied, hf_ref, tmp_path_factory):
    """A copy of ckpt_tied whose eos_token_id is the token STOP_PROMPT's greedy continuation
    produces first at position ``k``, and an engine on it."""
    ref = hf_ref.greedy(ckpt_tied.path, STOP_PROMPT, 20)
    k = first_new_token(ref)
    eos = ref.tokens[k]
    path = copy_checkpoint(ckpt_tied.path, str(tmp_path_factory.mktemp("qwen3-eos")), {"eos_token_id": eos})
    engine = make_llm(path, num_kvcache_blocks=32)
    yield SimpleNamespace(path=path, llm=engine, eos=eos, k=k, tokens=ref.tokens)
    engine.exit()


@pytest.fixture(scope="module")
def full_vocab(tmp_path_factory):
    """A tiny random Qwen3 with the whole Qwen3 vocabulary, so that chat templates' special tokens
    are in it."""
    path = str(tmp_path_factory.mktemp("qwen3-full-vocab"))
    make_random_checkpoint(path, dtype=torch.float32, seed=3, std=0.3)
    engine = make_llm(path, num_kvcache_blocks=32, max_num_seqs=8)
    yield SimpleNamespace(path=path, llm=engine, tokenizer=AutoTokenizer.from_pretrained(path))
    engine.exit()


# ---- 1. stop strings ---------------------------------------------------------------------------


def test_stop_string_spanning_two_tokens(llm, stop_case):
    c = stop_case
    out, kept = llm.generate(
        [STOP_PROMPT, STOP_PROMPT],
        [greedy(STOP_MAX_TOKENS, stop=c.stop), greedy(STOP_MAX_TOKENS, stop=[c.stop], include_stop_str_in_output=True)],
        use_tqdm=False,
    )
    what = f"stop={c.stop!r} completed by token {c.k}"
    assert out["token_ids"] == c.tokens[: c.k + 1], what
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", c.stop), what
    assert out["text"] == c.text[: c.at], f"{what}: text {out['text']!r}, expected {c.text[: c.at]!r}"
    assert kept["token_ids"] == c.tokens[: c.k + 1], what
    assert (kept["finish_reason"], kept["stop_reason"]) == ("stop", c.stop), what
    # token k goes on past the stop string: the text is cut right after it
    assert kept["text"] == c.text[: c.at + len(c.stop)] and kept["text"].endswith(c.stop), (what, kept["text"])


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
        assert (out["finish_reason"], out["stop_reason"]) == ("stop", c.stop), f"{name}: {out['stop_reason']!r}"
        assert out["text"] == c.text[: c.at], f"{name}: {out['text']!r}"


def test_stop_string_in_last_allowed_token(llm, stop_case, tokenizer):
    c = stop_case
    last, before = llm.generate(
        [STOP_PROMPT] * 2, [greedy(c.k + 1, stop=c.stop), greedy(c.k, stop=c.stop)], use_tqdm=False
    )
    assert last["token_ids"] == c.tokens[: c.k + 1]
    assert (last["finish_reason"], last["stop_reason"], last["text"]) == ("stop", c.stop, c.text[: c.at])
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
        [greedy(STOP_MAX_TOKENS, stop=c.stop, min_tokens=c.k),
         greedy(STOP_MAX_TOKENS, stop=c.stop, min_tokens=c.k + 1)],
        use_tqdm=False,
    )
    assert checked["token_ids"] == c.tokens[: c.k + 1] and checked["stop_reason"] == c.stop
    assert skipped["token_ids"] == c.tokens, "the stop string completed by token min_tokens must not stop"
    assert (skipped["finish_reason"], skipped["stop_reason"], skipped["text"]) == ("length", None, full)


# ---- 2. stop token ids, min_tokens, EOS -----------------------------------------------------------


def test_stop_token_ids(llm, stop_case, ckpt_tied, hf_ref):
    c = stop_case
    j, stop_id = c.j, c.tokens[c.j]
    never = next(t for t in range(VOCAB_SIZE) if t not in c.tokens)
    stopped, unused = llm.generate(
        [STOP_PROMPT] * 2,
        [greedy(STOP_MAX_TOKENS, stop_token_ids=[never, stop_id]), greedy(8, stop_token_ids=[never])],
        use_tqdm=False,
    )
    assert stopped["token_ids"] == c.tokens[: j + 1], f"stop id {stop_id} at position {j}"
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop_id)
    assert unused["token_ids"] == c.tokens[:8] and (unused["finish_reason"], unused["stop_reason"]) == ("length", None)

    # min_tokens past j: the id cannot be produced before min_tokens tokens exist
    model = hf_ref.model(ckpt_tied.path)
    for min_tokens in (j, j + 1, j + 4):  # j + 1: token j is the last suppressed one
        ref = hf_greedy_loop(model, STOP_PROMPT, STOP_MAX_TOKENS, suppress=[stop_id], min_tokens=min_tokens,
                             stop_ids=[stop_id])
        out = llm.generate([STOP_PROMPT], greedy(STOP_MAX_TOKENS, stop_token_ids=[stop_id], min_tokens=min_tokens),
                           use_tqdm=False)[0]
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
    out, ignoring = e.llm.generate([STOP_PROMPT] * 2, [greedy(20), greedy(20, ignore_eos=True)], use_tqdm=False)
    assert out["token_ids"] == ref.tokens, f"eos {e.eos} first produced at position {e.k}"
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", None)
    assert out["outputs"][0]["finish_reason"] == "stop"
    assert ignoring["token_ids"] == e.tokens and ignoring["finish_reason"] == "length"


def test_min_tokens_suppresses_eos(eos_case, hf_ref):
    e = eos_case
    model = hf_ref.model(e.path)
    for min_tokens in (e.k, e.k + 1, e.k + 3):  # k + 1: token k is the last suppressed one
        ref = hf_greedy_loop(model, STOP_PROMPT, 20, suppress=[e.eos], min_tokens=min_tokens, stop_ids=[e.eos])
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
        [greedy(STOP_MAX_TOKENS, stop_token_ids=[stop_id]),
         greedy(STOP_MAX_TOKENS, stop_token_ids=[stop_id], include_stop_str_in_output=True)],
        use_tqdm=False,
    )
    assert out["token_ids"] == kept["token_ids"] == c.tokens[: j + 1]
    assert kept["text"] == tokenizer.decode(c.tokens[: j + 1])
    assert out["text"] == tokenizer.decode(c.tokens[:j]), (
        f"stop_token_ids=[{stop_id}] ({tokenizer.decode([stop_id])!r}): text {out['text']!r} should leave it out"
    )
    e = eos_case
    eos_out = e.llm.generate([STOP_PROMPT], greedy(20), use_tqdm=False)[0]
    assert eos_out["token_ids"][-1] == e.eos
    assert eos_out["text"] == tokenizer.decode(e.tokens[: e.k]), (
        f"eos {e.eos} ({tokenizer.decode([e.eos])!r}): text {eos_out['text']!r} should leave it out"
    )


# ---- 3. penalties and logprobs against transformers ---------------------------------------------

PENALTY_CASES = [
    # (prompt seed, params, reference adjustment, the same with a wrong scope)
    (61, dict(repetition_penalty=1.5), repetition_penalty(1.5), repetition_penalty(1.5, "output")),
    (61, dict(presence_penalty=1.5), count_penalties(1.5, 0), count_penalties(1.5, 0, "prompt+output")),
    (61, dict(presence_penalty=-1.0), count_penalties(-1.0, 0), count_penalties(-1.0, 0, "prompt+output")),
    (70, dict(frequency_penalty=2.0), count_penalties(0, 2.0), count_penalties(0, 2.0, "prompt+output")),
    (69, dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
     lambda *a: (repetition_penalty(1.2)(*a), count_penalties(0.5, 0.5)(*a)), None),
]


def test_penalties_match_transformers(llm, ckpt_tied, hf_ref):
    model = hf_ref.model(ckpt_tied.path)
    max_tokens = 16
    prompts, params, refs = [], [], []
    for seed, kwargs, adjust, wrong in PENALTY_CASES:
        prompt = random_prompts(seed, [24])[0]
        plain = hf_ref.greedy(ckpt_tied.path, prompt, max_tokens)
        ref = hf_greedy_loop(model, prompt, max_tokens, adjust=adjust)
        assert ref.tokens != plain.tokens, f"{kwargs} must change the greedy tokens"
        if wrong is not None:
            other = hf_greedy_loop(model, prompt, max_tokens, adjust=wrong, until_not=ref.tokens)
            assert other.tokens != ref.tokens, f"{kwargs}: the wrong scope must give other tokens"
        prompts.append(prompt)
        params.append(greedy(max_tokens, **kwargs))
        refs.append(ref)
    plain_prompt = random_prompts(62, [24])[0]  # an unpenalised row in the same batch
    outputs = llm.generate(prompts + [plain_prompt], params + [greedy(max_tokens)], use_tqdm=False)
    for out, ref, (_, kwargs, _, _) in zip(outputs, refs, PENALTY_CASES):
        assert_greedy_match(out["token_ids"], ref, str(kwargs))
    assert_greedy_match(outputs[-1]["token_ids"], hf_ref.greedy(ckpt_tied.path, plain_prompt, max_tokens), "plain row")


def check_logprob_entries(out, ref_logprobs: torch.Tensor, num: int, what: str) -> None:
    """Each entry holds the sampled token and the ``num`` most likely ones, with transformers'
    values; ``cumulative_logprob`` is the sum over the sampled tokens."""
    assert len(out["logprobs"]) == len(out["token_ids"]), what
    for i, (token, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
        top = ref_logprobs[i].topk(num).indices.tolist()
        assert set(entry) == {token, *top}, f"{what}: token {i} entry {sorted(entry)}, expected {sorted({token, *top})}"
        for t, value in entry.items():
            reference = float(ref_logprobs[i, t])
            assert abs(value - reference) < 1e-4, f"{what}: token {i}, id {t}: {value} vs {reference}"
    sampled = [entry[t] for t, entry in zip(out["token_ids"], out["logprobs"])]
    assert out["cumulative_logprob"] == pytest.approx(sum(sampled), abs=1e-9), what
    ref_sum = sum(float(ref_logprobs[i, t]) for i, t in enumerate(out["token_ids"]))
    assert abs(out["cumulative_logprob"] - ref_sum) < 1e-3, what


def test_logprobs_match_transformers(llm, ckpt_tied, hf_ref):
    model = hf_ref.model(ckpt_tied.path)
    prompt, other = random_prompts(80, [17, 29])
    params = [
        greedy(8, logprobs=3),
        SamplingParams(temperature=5.0, seed=3, max_tokens=12, logprobs=2),  # samples far from the top
        SamplingParams(temperature=1.0, seed=4, max_tokens=6, logprobs=0),
        greedy(5),
    ]
    out, hot, only_sampled, none = llm.generate([prompt, prompt, other, other], params, use_tqdm=False)
    ref = hf_ref.greedy(ckpt_tied.path, prompt, 8)
    assert min(ref.gaps) > 100 * TIE_GAP
    assert out["token_ids"] == ref.tokens
    check_logprob_entries(out, hf_logprobs(model, prompt, out["token_ids"]), 3, "greedy, logprobs=3")
    assert all(len(entry) == 3 for entry in out["logprobs"])  # the sampled token is the top one
    check_logprob_entries(hot, hf_logprobs(model, prompt, hot["token_ids"]), 2, "temperature 5, logprobs=2")
    assert any(len(entry) == 3 for entry in hot["logprobs"]), "some sampled token should be outside the top 2"
    check_logprob_entries(only_sampled, hf_logprobs(model, other, only_sampled["token_ids"]), 0, "logprobs=0")
    assert (none["logprobs"], none["cumulative_logprob"]) == (None, None)
    for o in (out, hot, only_sampled):
        first = o["outputs"][0]
        assert (first["logprobs"], first["cumulative_logprob"]) == (o["logprobs"], o["cumulative_logprob"])


# ---- 4. n completions --------------------------------------------------------------------------


def test_n_completions_share_prompt_blocks(ckpt_tied):
    prompt = random_prompts(40, [40])[0]  # 2 full blocks + 8 tokens
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=6)
    with make_llm(ckpt_tied.path, num_kvcache_blocks=16) as llm:
        sched, bm = llm.scheduler, llm.scheduler.block_manager
        rid = llm.add_request(prompt, params)
        _, num_tokens = llm.step()
        # completion 0 computes the prompt; the others wait for its blocks to be in the cache
        assert num_tokens == 40
        assert [s.seq_id for s in sched.running] == [rid] and [s.seq_id for s in sched.waiting] == [rid + 1, rid + 2]
        assert sched.running[0].block_table == [0, 1, 2]
        _, num_tokens = llm.step()
        assert num_tokens == 16, "completions 1 and 2 compute only their last, partial block"
        tables = {s.seq_id: s.block_table for s in sched.running}
        assert tables == {rid: [0, 1, 2], rid + 1: [0, 1, 3], rid + 2: [0, 1, 4]}, tables
        assert [bm.blocks[b].ref_count for b in range(6)] == [3, 3, 1, 1, 1, 0]
        assert {s.seq_id: s.num_prefix_hit_tokens for s in sched.running} == {rid: 0, rid + 1: 32, rid + 2: 32}
        finished = run_to_completion(llm)
        assert sorted(finished) == [rid, rid + 1, rid + 2] and all(len(t) == 6 for t in finished.values())
        assert llm.get_stats()["prompt_tokens"] == 56
        assert len({tuple(t) for t in finished.values()}) == 3, "three seeds should give three completions"
        assert_idle(llm)

        # the same request through generate: the same completions, in order, the prompt from the cache
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert [c["index"] for c in out["outputs"]] == [0, 1, 2]
        assert [c["token_ids"] for c in out["outputs"]] == [finished[rid + i] for i in range(3)]
        first = out["outputs"][0]
        for key in ("text", "token_ids", "finish_reason", "stop_reason", "logprobs", "cumulative_logprob"):
            assert out[key] == first[key], key
        assert out["prompt_token_ids"] == prompt and out["num_cached_tokens"] == 32
        assert all(c["finish_reason"] == "length" for c in out["outputs"])

        # completion i is the request with seed + i
        singles = llm.generate(
            [prompt] * 3, [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=6) for i in range(3)], use_tqdm=False
        )
        assert [s["token_ids"] for s in singles] == [c["token_ids"] for c in out["outputs"]]


# ---- 5. seeded sampling -------------------------------------------------------------------------


def test_seeded_request_independent_of_batch(llm):
    prompt = random_prompts(50, [21])[0]
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=1234, max_tokens=16)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    others = random_prompts(51, [3, 40, 70])
    batch = [others[0], others[1], prompt, others[2], prompt]
    params = [
        greedy(5),
        SamplingParams(temperature=1.0, max_tokens=20),
        seeded,
        SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5, max_tokens=25, seed=9),
        SamplingParams(temperature=0.8, top_k=50, seed=1235, max_tokens=16),
    ]
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert outputs[2]["token_ids"] == alone, "a seeded request must not depend on the batch around it"
    assert outputs[4]["token_ids"] != alone, "another seed should draw other tokens"
    assert llm.generate([prompt], greedy(16), use_tqdm=False)[0]["token_ids"] != alone, "the draw is not greedy"


# ---- 6. chat ------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]
OTHER_CONVERSATION = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


def chat_ids(tokenizer, conversation, **kwargs) -> list[int]:
    encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=True, **kwargs)
    return list(encoded["input_ids"])


def test_chat_applies_template(full_vocab, hf_ref):
    llm, tok = full_vocab.llm, full_vocab.tokenizer
    expected = chat_ids(tok, CONVERSATION)
    outputs = llm.chat(CONVERSATION, greedy(4), use_tqdm=False)
    assert len(outputs) == 1 and outputs[0]["prompt_token_ids"] == expected
    assert_greedy_match(outputs[0]["token_ids"], hf_ref.greedy(full_vocab.path, expected, 4), "chat")

    both = llm.chat([CONVERSATION, OTHER_CONVERSATION], greedy(2), use_tqdm=False)
    assert [o["prompt_token_ids"] for o in both] == [expected, chat_ids(tok, OTHER_CONVERSATION)]

    no_thinking = llm.chat(CONVERSATION, greedy(2), use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    reference = chat_ids(tok, CONVERSATION, enable_thinking=False)
    assert reference != expected
    assert no_thinking[0]["prompt_token_ids"] == reference


@pytest.mark.parametrize(
    "messages, where",
    [
        pytest.param([CONVERSATION, "Name a prime number."], "messages[1]", id="conversation-not-a-list"),
        pytest.param([CONVERSATION, []], "messages[1]", id="empty-conversation"),
        pytest.param([{"content": "no role"}], "messages[0][0]", id="message-without-role"),
        pytest.param(CONVERSATION + [{"role": "user"}], "messages[0][2]", id="message-without-content"),
        pytest.param([OTHER_CONVERSATION, [{"role": "user", "content": 5}]], "messages[1][0]", id="content-not-str"),
        pytest.param([CONVERSATION, [CONVERSATION[0], "hi"]], "messages[1][1]", id="message-not-a-dict"),
    ],
)
def test_chat_rejects_bad_messages(full_vocab, messages, where):
    llm = full_vocab.llm
    with pytest.raises(TypeError) as e:
        llm.chat(messages, greedy(2), use_tqdm=False)
    assert where in str(e.value), str(e.value)
    assert_idle(llm)


def test_chat_rejects_non_list(full_vocab):
    with pytest.raises(TypeError, match="messages"):
        full_vocab.llm.chat("Name a prime number.", greedy(2), use_tqdm=False)
    assert_idle(full_vocab.llm)


# ---- 7. stream ----------------------------------------------------------------------------------


def collect_stream(llm, prompts, params) -> dict[tuple[int, int], list[dict]]:
    increments = defaultdict(list)
    for inc in llm.stream(prompts, params):
        increments[(inc["index"], inc["completion"])].append(inc)
    return increments


def check_increments(increments: list[dict], expected: dict, reference_text: str, what: str) -> None:
    """The increments of one completion add up to ``expected`` (a generate completion), only the
    last is final, and no text handed out before it ends inside a character: a running increment
    may end in U+FFFD only where the tokenizer's decoding of all the completion's tokens
    (``reference_text``) has a replacement character of its own (an invalid byte), never the
    first bytes of a character still coming."""
    *running, final = increments
    assert all(not inc["finished"] for inc in running) and final["finished"], what
    assert (final["finish_reason"], final["stop_reason"]) == (expected["finish_reason"], expected["stop_reason"]), what
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
        check_increments(incs, out, tokenizer.decode(out["token_ids"]), f"prompts[{index}] completion {completion}")
    reasons = [c["stop_reason"] for o in expected for c in o["outputs"]]
    assert any(isinstance(r, str) for r in reasons) and None in reasons, f"want both endings: {reasons}"
    for o in expected:
        for c in o["outputs"]:
            if c["finish_reason"] == "length":
                assert c["text"] == tokenizer.decode(c["token_ids"])
    assert_idle(llm)


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """``text`` as one byte-level token per UTF-8 byte (GPT-2's byte alphabet, which Qwen's first
    256 ids hold): its multi-byte characters are split over 2 to 4 tokens."""
    alphabet = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1)
    )
    chars = {b: chr(b) for b in alphabet}
    chars |= {b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in chars)}
    ids = [tokenizer.convert_tokens_to_ids(chars[b]) for b in text.encode()]
    assert max(ids) < VOCAB_SIZE and tokenizer.decode(ids) == text
    return ids


def script_tokens(llm, monkeypatch, scripts: dict[tuple[int, ...], list[int]]) -> None:
    """Fake sampling, as vLLM's core tests do: a sequence whose prompt is a key of ``scripts`` gets
    the script's next token instead of the sampled one when the host learns the step's tokens
    (the model still runs, on the sampled ones)."""
    real_run = llm.model_runner.run

    def run(seqs, is_prefill, prev_rows=None):
        output = real_run(seqs, is_prefill, prev_rows)
        scripted = [(i, script[seq.num_completion_tokens]) for i, seq in enumerate(seqs)
                    if (script := scripts.get(tuple(seq.prompt_token_ids))) is not None]
        real_result = output.result

        def result():
            token_ids, logprobs = real_result()
            for i, token_id in scripted:
                token_ids[i] = token_id
            return token_ids, logprobs

        output.result = result
        return output

    monkeypatch.setattr(llm.model_runner, "run", run)


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
        assert all("\ufffd" not in inc["text"] for inc in incs), f"prompts[{index}]: {[i['text'] for i in incs]}"
    # without stop strings, each character is handed out in the step that completes it
    sent_text, sent_tokens = "", 0
    for inc in increments[(0, 0)]:
        sent_text += inc["text"]
        sent_tokens += len(inc["token_ids"])
        assert sent_text == data[:sent_tokens].decode("utf-8", errors="ignore"), (sent_tokens, sent_text)


def test_stream_break_aborts_its_requests(llm, ckpt_tied, hf_ref):
    queued = random_prompts(72, [13])[0]
    queued_id = llm.add_request(queued, greedy(30))
    seen = 0
    for _ in llm.stream(random_prompts(71, [5, 20, 35]), SamplingParams(temperature=0.8, max_tokens=40, n=2)):
        seen += 1
        if seen == 5:
            break
    assert seen == 5
    # the add_request's request goes on; the stream's are gone
    assert [s.seq_id for s in llm.scheduler.running] + [s.seq_id for s in llm.scheduler.waiting] == [queued_id]
    finished = run_to_completion(llm)
    assert list(finished) == [queued_id]
    assert_greedy_match(finished[queued_id], hf_ref.greedy(ckpt_tied.path, queued, 30), "queued request")
    assert_idle(llm)

    stream = llm.stream([queued], greedy(30))
    next(stream)
    stream.close()
    assert_idle(llm)
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)


# ---- 8. abort and interrupted calls ---------------------------------------------------------------


def test_abort_request(llm, ckpt_tied, hf_ref):
    sched, bm = llm.scheduler, llm.scheduler.block_manager
    running_prompt, waiting_prompt, pair_prompt = random_prompts(90, [40, 20, 35])
    running_id = llm.add_request(running_prompt, greedy(10))
    llm.step()
    waiting_id = llm.add_request(waiting_prompt, greedy(10))
    pair_id = llm.add_request(pair_prompt, SamplingParams(n=2, temperature=0.5, max_tokens=10))
    assert [s.seq_id for s in sched.running] == [running_id]
    assert [s.seq_id for s in sched.waiting] == [waiting_id, pair_id, pair_id + 1]
    held = list(sched.running[0].block_table)
    assert len(held) == 3 and all(bm.blocks[b].ref_count == 1 for b in held)

    assert llm.abort_request(running_id) is True
    assert all(b in bm.free_block_ids and bm.blocks[b].ref_count == 0 for b in held)
    assert llm.abort_request(waiting_id) is True
    llm.step()  # the pair's first completion is admitted, the second waits for its prompt
    assert [s.seq_id for s in sched.running] == [pair_id] and [s.seq_id for s in sched.waiting] == [pair_id + 1]
    assert llm.abort_request(pair_id + 1) is False, "a completion's id is not a request id"
    assert llm.abort_request(pair_id) is True
    assert_idle(llm)
    assert llm.step() == ([], 0), "aborted requests are not reported"
    for request_id in (running_id, waiting_id, pair_id, 10**9):
        assert llm.abort_request(request_id) is False
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)


def failing_run(llm, monkeypatch, fail_at: int, exc=KeyboardInterrupt):
    """Make the model runner's ``fail_at``-th step raise ``exc`` (as a Ctrl-C or an error inside a step)."""
    real_run = llm.model_runner.run
    calls = []

    def run(seqs, is_prefill, *args):
        calls.append(is_prefill)
        if len(calls) == fail_at:
            raise exc("interrupted inside a step")
        return real_run(seqs, is_prefill, *args)

    monkeypatch.setattr(llm.model_runner, "run", run)
    return calls


def test_interrupted_generate_aborts_only_its_requests(llm, ckpt_tied, hf_ref, monkeypatch):
    queued = random_prompts(91, [18])[0]
    queued_id = llm.add_request(queued, greedy(12))
    calls = failing_run(llm, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts(92, [10, 33]), greedy(10), use_tqdm=False)
    assert calls == [True, False, False]
    monkeypatch.undo()
    # the queued request is not aborted (the failed step put it back at the head of waiting, to be
    # recomputed); the generate's requests are
    assert [s.seq_id for s in llm.scheduler.waiting] == [queued_id] and not llm.scheduler.running
    assert llm.get_stats()["num_requests_waiting"] == 1
    finished = run_to_completion(llm)
    assert list(finished) == [queued_id]
    assert_greedy_match(finished[queued_id], hf_ref.greedy(ckpt_tied.path, queued, 12), "queued request")
    assert_idle(llm)

    # without anything queued, the engine is idle right after the interruption
    failing_run(llm, monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts(93, [25, 7, 50]), SamplingParams(temperature=0.7, max_tokens=10), use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)


def test_error_in_prefill_step_spares_queued_request(llm, ckpt_tied, hf_ref, monkeypatch):
    """An exception inside the step that prefills a queued add_request (and the generate's own
    prompts): the generate's requests are aborted, the queued one still gets correct tokens."""
    queued = random_prompts(94, [26])[0]
    queued_id = llm.add_request(queued, greedy(8))
    failing_run(llm, monkeypatch, 1, RuntimeError)
    with pytest.raises(RuntimeError, match="interrupted"):
        llm.generate(random_prompts(95, [12]), greedy(8), use_tqdm=False)
    monkeypatch.undo()
    finished = run_to_completion(llm)
    assert list(finished) == [queued_id]
    assert_greedy_match(finished[queued_id], hf_ref.greedy(ckpt_tied.path, queued, 8), "queued request")
    assert_idle(llm)


@pytest.mark.skipif(
    signal.getsignal(signal.SIGINT) is not signal.default_int_handler, reason="needs Python's SIGINT handler"
)
@pytest.mark.parametrize("queued_max_tokens", [8, 1], ids=["queued-runs-on", "queued-finishes-in-that-step"])
def test_ctrl_c_during_generate(llm, ckpt_tied, hf_ref, monkeypatch, queued_max_tokens):
    """A real Ctrl-C in the middle of a step takes effect when the step is complete: the queued
    add_request's request (prefilled in that step) keeps its result, the generate's are aborted."""
    queued = random_prompts(96, [22])[0]
    queued_id = llm.add_request(queued, greedy(queued_max_tokens))
    real_run = llm.model_runner.run

    def run(seqs, is_prefill, *args):
        os.kill(os.getpid(), signal.SIGINT)  # delivered while the step computes
        return real_run(seqs, is_prefill, *args)

    monkeypatch.setattr(llm.model_runner, "run", run)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts(97, [15, 40]), greedy(10), use_tqdm=False)
    monkeypatch.undo()
    left = [*llm.scheduler.waiting, *llm.scheduler.running]
    if queued_max_tokens > 1:  # its prefill step was completed, the generate's requests aborted
        assert [(s.seq_id, s.num_cached_tokens, len(s)) for s in left] == [(queued_id, 22, 23)]
    else:
        assert left == []
    finished = run_to_completion(llm)
    assert list(finished) == [queued_id], f"the queued request's result is lost: {finished}"
    ref = hf_ref.greedy(ckpt_tied.path, queued, queued_max_tokens)
    assert_greedy_match(finished[queued_id], ref, "queued request")
    assert_idle(llm)


# ---- 9. get_stats -------------------------------------------------------------------------------


def test_get_stats(ckpt_tied, hf_ref):
    # step by step, the serial path (tokens counted in the step that computes them)
    with make_llm(ckpt_tied.path, num_kvcache_blocks=8, async_scheduling=False) as llm:
        stats = llm.get_stats()
        assert all(value == 0 for value in stats.values()), stats
        short, shared = random_prompts(100, [10, 40])
        llm.add_request(short, greedy(8))
        llm.add_request(shared, SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=8))

        def counts():
            s = llm.get_stats()
            return (s["num_requests_running"], s["num_requests_waiting"], s["kv_cache_usage"], s["prompt_tokens"],
                    s["generation_tokens"], s["prefix_cache_hit_rate"])

        llm.step()  # prefill: short (1 block) and the first completion (3 blocks); the second waits
        assert counts() == (2, 1, 4 / 8, 50, 2, 0.0)
        llm.step()  # prefill of the second completion: its last 8 tokens, 32 from the cache
        assert counts() == (3, 0, 5 / 8, 58, 3, 32 / 90)
        llm.step()  # decode
        assert counts() == (3, 0, 5 / 8, 58, 6, 32 / 90)
        run_to_completion(llm)
        assert counts() == (0, 0, 0.0, 58, 24, 32 / 90)

        out = llm.generate([shared], greedy(4), use_tqdm=False)[0]
        assert out["num_cached_tokens"] == 32
        assert_greedy_match(out["token_ids"], hf_ref.greedy(ckpt_tied.path, shared, 4), "repeated prompt")
        assert counts() == (0, 0, 0.0, 66, 28, 64 / 130)
        stats = llm.get_stats()
        assert stats["num_preemptions"] == 0 and stats["prefill_throughput"] > 0 and stats["decode_throughput"] > 0

        # four requests of 60 tokens (4 blocks each) in 8 blocks: preemption
        prompts = random_prompts(101, [30, 30, 30, 30])
        outputs = llm.generate(prompts, greedy(30), use_tqdm=False)
        for i, (o, p) in enumerate(zip(outputs, prompts)):
            assert_greedy_match(o["token_ids"], hf_ref.greedy(ckpt_tied.path, p, 30), f"prompts[{i}]")
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0
        assert stats["generation_tokens"] == 28 + 120
        assert stats["prompt_tokens"] >= 66 + 120
        assert_idle(llm)


# ---- 10. default sampling params ----------------------------------------------------------------


@pytest.mark.parametrize(
    "generation_config, expected",
    [
        pytest.param("keep", SamplingParams(temperature=0.6, top_p=0.95, top_k=20), id="qwen3"),
        pytest.param(None, SamplingParams(), id="no-file"),
        pytest.param({"temperature": 0.3, "repetition_penalty": 1.2},
                     SamplingParams(temperature=0.3, repetition_penalty=1.2), id="temperature-repetition"),
        pytest.param({"temperature": 0.3, "top_k": None, "do_sample": True}, SamplingParams(temperature=0.3),
                     id="null-values-skipped"),
        pytest.param({"max_new_tokens": 7, "min_p": 0.05}, SamplingParams(max_tokens=7, min_p=0.05),
                     id="max-new-tokens"),
    ],
)
def test_default_sampling_params(ckpt_tied, tmp_path, generation_config, expected):
    path = copy_checkpoint(ckpt_tied.path, str(tmp_path / "model"), generation_config=generation_config)
    with make_llm(path, num_kvcache_blocks=8) as llm:
        assert llm.get_default_sampling_params() == expected


def test_generate_without_params_uses_defaults(ckpt_tied, hf_ref, tmp_path):
    path = copy_checkpoint(ckpt_tied.path, str(tmp_path / "model"), generation_config={"temperature": 0.0})
    prompt = random_prompts(110, [11])[0]
    with make_llm(path, num_kvcache_blocks=8, max_model_len=24) as llm:  # max_model_len ends it early
        out = llm.generate([prompt], use_tqdm=False)[0]
    assert len(out["token_ids"]) == 24 - len(prompt) and out["finish_reason"] == "length"
    ref = hf_ref.greedy(ckpt_tied.path, prompt, 24 - len(prompt))
    assert_greedy_match(out["token_ids"], ref, "generate(prompts) with the folder's defaults (temperature 0)")


def test_generate_makes_each_output_when_its_request_finishes(llm):
    """A request's output (its text decoded) is made in the step loop once it finishes, while the
    others still run, not after the last step; the returned list is still in prompt order."""
    prompts = random_prompts(131, [5, 7, 9])
    made = []
    make = llm._request_output

    def record(request):
        made.append((request.prompt_token_ids, len(llm.scheduler.running)))
        return make(request)

    llm._request_output = record
    try:
        outputs = llm.generate(prompts, [greedy(20), greedy(2), greedy(20)], use_tqdm=False)
    finally:
        del llm._request_output
    assert made[0] == (prompts[1], 2)  # the short request, while both long ones still decode
    assert sorted(p for p, _ in made) == sorted(prompts) and len(made) == 3
    assert [len(o["token_ids"]) for o in outputs] == [20, 2, 20]
    assert [o["prompt_token_ids"] for o in outputs] == prompts
    assert_idle(llm)


# ---- 11. prompts as arrays and tensors ----------------------------------------------------------


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
        assert out["prompt_token_ids"] == prompt and all(type(t) is int for t in out["prompt_token_ids"]), f"form {i}"
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


# ---- 12. invalid SamplingParams -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("top_p", 0, ValueError), ("top_p", 1.5, ValueError), ("top_p", math.nan, ValueError),
        ("top_p", "x", TypeError),
        ("top_k", -2, ValueError), ("top_k", 1.5, TypeError),
        ("min_p", -0.1, ValueError), ("min_p", 1.1, ValueError),
        ("seed", 1.5, TypeError),
        ("stop", 3, TypeError), ("stop", [""], ValueError), ("stop", ["a", 1], TypeError),
        ("stop_token_ids", [-1], ValueError), ("stop_token_ids", "x", TypeError), ("stop_token_ids", [1.0], TypeError),
        ("include_stop_str_in_output", "yes", TypeError),
        ("min_tokens", -1, ValueError),
        ("repetition_penalty", 0, ValueError), ("repetition_penalty", -1, ValueError),
        ("repetition_penalty", math.inf, ValueError),
        ("presence_penalty", 2.5, ValueError), ("frequency_penalty", -3, ValueError),
        ("logprobs", -1, ValueError), ("logprobs", 1.5, TypeError),
        ("n", 0, ValueError), ("n", 2.0, TypeError),
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
        llm.generate(prompts, [greedy(4, stop_token_ids=[VOCAB_SIZE - 1]), greedy(4, stop_token_ids=[3, VOCAB_SIZE])],
                     use_tqdm=False)
    message = str(e.value)
    assert "prompts[1]" in message and str(VOCAB_SIZE) in message and "stop_token_ids" in message, message
    assert_idle(llm)
    with pytest.raises(ValueError, match=str(VOCAB_SIZE)):
        llm.add_request(prompts[0], greedy(4, stop_token_ids=[VOCAB_SIZE]))
    assert_idle(llm)
    assert_serves_correctly(llm, ckpt_tied.path, hf_ref)
