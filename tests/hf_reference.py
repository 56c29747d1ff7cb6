"""Tiny random Qwen3 checkpoints (float32) and an independent greedy reference built on
Hugging Face transformers, for the end-to-end tests."""

import json
import os
import random
from dataclasses import dataclass

import torch

from nanovllm.utils.checkpoint import make_random_checkpoint

VOCAB_SIZE = 512
BLOCK_SIZE = 16
TIE_GAP = 1e-4  # reference top-2 logits closer than this are a tie: either token is correct


@dataclass(frozen=True)
class TinyCheckpoint:
    path: str
    rope_theta: float
    head_dim: int
    tie_word_embeddings: bool
    rope_style: str  # "top-level" (transformers 4.x) or "rope_parameters" (transformers 5)


def build_checkpoint(
    path: str,
    *,
    seed: int,
    rope_theta: float,
    rope_style: str,
    tie_word_embeddings: bool,
    head_dim: int = 32,
    eos_token_id: int | None = None,
    std: float = 0.3,
) -> TinyCheckpoint:
    """hidden 64, 4 heads, 2 KV heads, 2 layers, vocab 512; ``head_dim`` is explicit (32 != 64 / 4).
    Large weights (``std``) keep the logits apart, so greedy parity is not decided by rounding."""
    overrides = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        num_hidden_layers=2,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=512,
        rope_theta=rope_theta,
        bos_token_id=0,
        eos_token_id=VOCAB_SIZE + 1
        if eos_token_id is None
        else eos_token_id,  # default: never produced
    )
    make_random_checkpoint(path, dtype=torch.float32, seed=seed, std=std, **overrides)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    if rope_style == "rope_parameters":
        del config["rope_theta"]
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    elif rope_style != "top-level":
        raise ValueError(rope_style)
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    return TinyCheckpoint(path, rope_theta, head_dim, tie_word_embeddings, rope_style)


@dataclass
class GreedyRef:
    tokens: list[int]
    gaps: list[float]  # top-1 minus top-2 logit at each generated position
    stopped: bool  # ended on the EOS token


class HFReference:
    """A plain transformers greedy loop: full recompute of the whole sequence each step, argmax."""

    def __init__(self):
        self._models = {}
        self._cache = {}

    def model(self, path: str):
        if path not in self._models:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            )
            self._models[path] = model.eval()
        return self._models[path]

    def greedy(
        self, path: str, prompt: list[int], max_tokens: int, stop_on_eos: bool = False
    ) -> GreedyRef:
        key = (path, tuple(prompt), max_tokens, stop_on_eos)
        if key in self._cache:
            return self._cache[key]
        model = self.model(path)
        eos = model.config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        ids = list(prompt)
        tokens, gaps, stopped = [], [], False
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].double()
                top = logits.topk(2).values
                token = int(logits.argmax())
                tokens.append(token)
                gaps.append(float(top[0] - top[1]))
                ids.append(token)
                if stop_on_eos and token in eos:
                    stopped = True
                    break
        self._cache[key] = ref = GreedyRef(tokens, gaps, stopped)
        return ref


def greedy_logprobs(model, prompt: list[int], max_tokens: int) -> tuple[GreedyRef, list[float]]:
    """A model's greedy tokens (full recompute each token), top-2 gaps and log-probabilities."""
    ids, tokens, gaps, logprobs = list(prompt), [], [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            top = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            gaps.append(float(top[0] - top[1]))
            logprobs.append(float(torch.log_softmax(logits, -1)[tokens[-1]]))
            ids.append(tokens[-1])
    return GreedyRef(tokens, gaps, False), logprobs


def assert_greedy_match(got: list[int], ref: GreedyRef, what: str = "") -> None:
    """``got`` must equal the reference token for token. At the first difference the reference's
    top-2 logits must be a tie (within TIE_GAP); after such a tie the continuations may differ
    legitimately, so comparison stops there."""
    for i, (a, b) in enumerate(zip(got, ref.tokens)):
        if a != b:
            assert ref.gaps[i] < TIE_GAP, (
                f"{what}: token {i} is {a}, reference {b} (top-2 gap {ref.gaps[i]:.3g}); "
                f"got {got}, reference {ref.tokens}"
            )
            return
    assert len(got) == len(ref.tokens), (
        f"{what}: {len(got)} tokens, reference {len(ref.tokens)}: {got} vs {ref.tokens}"
    )


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in lengths]


def mixed_prompts() -> list[list[int]]:
    """Lengths 1..120 around block boundaries, plus prompts sharing prefixes (block-aligned or
    not)."""
    prompts = random_prompts(0, [1, 2, 7, 15, 16, 17, 31, 33, 64, 90, 120])
    base = prompts[-1]  # 120 tokens
    rng = random.Random(1)
    prompts.append(
        base[:48] + [rng.randrange(VOCAB_SIZE) for _ in range(20)]
    )  # shares 3 full blocks
    prompts.append(base[:40] + [rng.randrange(VOCAB_SIZE) for _ in range(5)])  # shares 2.5 blocks
    prompts.append(base[:100])  # a prefix of another prompt
    prompts.append(list(base))  # an exact duplicate
    return prompts


def edit_json(folder: str, name: str = "config.json", **changes) -> None:
    """Change keys of the JSON file ``folder/name`` in place (a value of None removes the key)."""
    path = os.path.join(folder, name)
    with open(path) as f:
        data = json.load(f)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
