"""Fixed workloads on the tiny checkpoints whose outputs on the CPU are recorded in
``tiny_outputs.json``: greedy through chunked prefill, preemption and prefix-cache hits, ``n > 1``
(greedy and seeded), stop strings, logprobs and ``max_model_len``, on one rank and on two.

``python tests/golden/cases.py`` rewrites the file; the test compares every run with it.
"""

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_FILE = os.path.join(HERE, "tiny_outputs.json")
sys.path.insert(0, os.path.dirname(HERE))  # hf_reference

from hf_reference import BLOCK_SIZE, build_checkpoint, mixed_prompts  # noqa: E402

CHECKPOINTS = {
    "tied": dict(seed=1, rope_theta=12345.0, rope_style="top-level", tie_word_embeddings=True),
    "untied": dict(
        seed=2, rope_theta=5432.1, rope_style="rope_parameters", tie_word_embeddings=False
    ),
}
BASE_CONFIG = dict(
    device="cpu", kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=256, max_model_len=256
)
CONFIGS = {
    "roomy": {},
    "chunked_preempted": dict(max_num_batched_tokens=64, num_kvcache_blocks=14),
    "short_model_len": dict(max_model_len=128),
}
# text cut from a roomy greedy completion: stop strings that do occur
STOP_PROMPTS = [3, 9, 10]


def summary(out: dict) -> dict:
    """What a run must reproduce exactly (logprobs rounded: float32 on the CPU)."""

    def completion(c):
        logprobs = (
            None
            if c["logprobs"] is None
            else [
                sorted((int(t), round(v, 4)) for t, v in entry.items()) for entry in c["logprobs"]
            ]
        )
        return {
            "text": c["text"],
            "token_ids": c["token_ids"],
            "finish_reason": c["finish_reason"],
            "stop_reason": c["stop_reason"],
            "logprobs": logprobs,
        }

    return {
        "num_cached_tokens": out["num_cached_tokens"],
        "outputs": [completion(c) for c in out["outputs"]],
    }


def run_checkpoint(path: str, tp: int, stops: dict | None = None) -> dict:
    """Every workload on one checkpoint with ``tp`` ranks; ``stops`` (prompt index -> stop string)
    is taken from the roomy run when not given."""
    from nanovllm import LLM, SamplingParams

    prompts = mixed_prompts()
    greedy = SamplingParams(temperature=0, max_tokens=16)
    results = {}
    for name, overrides in CONFIGS.items():
        with LLM(path, tensor_parallel_size=tp, **(BASE_CONFIG | overrides)) as llm:
            first = llm.generate(prompts, greedy, use_tqdm=False)
            results[name] = [summary(o) for o in first]
            if name != "roomy":
                continue
            results["prefix_hits"] = [
                summary(o) for o in llm.generate(prompts, greedy, use_tqdm=False)
            ]
            if stops is None:
                stops = {i: first[i]["text"][4:7] for i in STOP_PROMPTS}
            stop_params = [
                SamplingParams(
                    temperature=0,
                    max_tokens=16,
                    stop=[stops[i]],
                    include_stop_str_in_output=bool(k % 2),
                )
                for k, i in enumerate(stops)
            ]
            outs = llm.generate([prompts[i] for i in stops], stop_params, use_tqdm=False)
            results["stop_strings"] = [summary(o) for o in outs]
            n_params = [
                SamplingParams(temperature=0, n=2, max_tokens=10, logprobs=2),
                SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=10),
            ]
            outs = llm.generate([prompts[8], prompts[10]], n_params, use_tqdm=False)
            results["n_greedy_logprobs_and_seeded"] = [summary(o) for o in outs]
    return {"stops": {str(i): s for i, s in stops.items()}, "results": results}


def build(name: str, root: str) -> str:
    path = os.path.join(root, name)
    build_checkpoint(path, **CHECKPOINTS[name])
    return path


def main() -> None:
    golden = {}
    with tempfile.TemporaryDirectory() as root:
        for name in CHECKPOINTS:
            path = build(name, root)
            for tp in (1, 2):
                golden[f"{name}/tp{tp}"] = run_checkpoint(path, tp)
    with open(GOLDEN_FILE, "w") as f:
        json.dump(golden, f, indent=1, ensure_ascii=True)
        f.write("\n")


if __name__ == "__main__":
    main()
