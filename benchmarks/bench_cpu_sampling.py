"""Time top-p and min-p sampling against greedy on the CPU (one thread, the tiny random Qwen3
with the full Qwen3 vocabulary): 8 prompts x 32 tokens, best of 3 generates each.

    python benchmarks/bench_cpu_sampling.py [CHECKOUT]   # CHECKOUT: another checkout to time
"""

import os
import sys
import tempfile
import time

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(__file__) + "/..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.checkpoint import make_random_checkpoint  # noqa: E402

SETTINGS = {"greedy": {"temperature": 0}, "top_p=0.9": {"top_p": 0.9}, "min_p=0.1": {"min_p": 0.1}}


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random_checkpoint(tmp, "tiny")
        llm = LLM(path, enforce_eager=True, max_model_len=256, num_kvcache_blocks=64,
                  kvcache_block_size=16, device="cpu")  # fmt: skip
        prompts = [[i + 1, i + 2, i + 3] for i in range(8)]
        for name, kwargs in SETTINGS.items():
            params = SamplingParams(max_tokens=32, ignore_eos=True, seed=0, **kwargs)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                best = min(best, time.perf_counter() - start)
            print(f"{name}: {best * 1000:.0f} ms")
        llm.exit()


if __name__ == "__main__":
    main()
