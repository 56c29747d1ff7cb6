"""Helpers of the offline-API tests (``tests/api``): engines on the tiny checkpoints, the
transformers references (greedy loops with penalties, masked ids and stop conditions applied to its
logits; log-softmax for logprobs), and checks that an engine is idle and still serves correctly.
"""

import json
import math
import os
import shutil
from collections import Counter

import torch
from hf_reference import BLOCK_SIZE, TIE_GAP, GreedyRef, assert_greedy_match, random_prompts

from nanovllm import LLM, SamplingParams

MAX_MODEL_LEN = 256
STOP_PROMPT = random_prompts(102, [12])[0]  # its greedy continuation has clean text to cut
STOP_MAX_TOKENS = 24


def make_llm(path: str, **kwargs) -> LLM:
    kwargs = (
        dict(kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=96, max_model_len=MAX_MODEL_LEN)
        | dict(max_logprobs=-1)  # tests ask for whole-vocabulary logprobs
        | kwargs
    )
    return LLM(path, **kwargs)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def copy_checkpoint(
    src: str, dst: str, config_changes: dict | None = None, generation_config="keep"
) -> str:
    """A copy of checkpoint ``src`` (same weights) with ``config_changes`` in config.json and
    ``generation_config`` (a dict, None = no file, "keep" = the source's) as
    generation_config.json."""
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


def hf_greedy_loop(
    model,
    prompt: list[int],
    max_tokens: int,
    *,
    adjust=None,
    suppress=(),
    min_tokens: int = 0,
    stop_ids=(),
    until_not=None,
) -> GreedyRef:
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
    """log_softmax of transformers' float32 logits at each completion position:
    [len(completion), vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(
        logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)], dim=-1
    ).double()


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
    raise AssertionError(
        f"no stop string spanning two clean tokens from token {first} on: {tokens}"
    )


def first_new_token(ref: GreedyRef, start: int = 3) -> int:
    """The first position >= ``start`` whose token does not occur before it, with no near-tie up
    to there."""
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
    bm = llm.core.scheduler.block_manager
    assert not bm.used_block_ids and all(b.ref_count == 0 for b in bm.blocks), "blocks still held"


def assert_serves_correctly(llm, path, hf_ref, seed=7) -> None:
    """A greedy batch gives the transformers tokens and leaves the engine idle."""
    prompts = random_prompts(seed, [3, 20, 41])
    outputs = llm.generate(prompts, greedy(6), use_tqdm=False)
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert out["prompt_token_ids"] == prompt
        assert_greedy_match(out["token_ids"], hf_ref.greedy(path, prompt, 6), f"prompts[{i}]")
    assert_idle(llm)
