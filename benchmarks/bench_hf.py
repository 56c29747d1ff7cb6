"""``bench.py``'s workload through Hugging Face transformers, the reference a user would otherwise
reach for: the model built from a shape's ``config.json`` with random bf16 weights on the GPU, all
requests in one left-padded batch through ``generate`` (sampling at temperature 0.6, no EOS), with
transformers' default attention and cache. ``generate`` runs until the longest request is done, so
only each request's own ``max_tokens`` count as output. ``--max-time`` stops it early (transformers'
own ``max_time``); the figure is then over the steps it reached, which favours transformers (its
steps get slower as the cache grows). GPU only.

    python benchmarks/bench_hf.py --random qwen3-30b-a3b --max-time 300

Run it from the repository root as ``python benchmarks/bench_hf.py ...``. It imports ``bench``
(``bench.py``'s workload) through the repository root, which the first lines below put on
``sys.path``; tools of this folder import each other by their plain names (a script's own
folder is on ``sys.path``).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.py

from bench import workload  # noqa: E402
from nanovllm.utils.checkpoint import model_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--random", metavar="SHAPE", default="qwen3-0.6b")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-time", type=float, default=None, help="seconds; stop generate after this"
    )
    args = parser.parse_args()
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**model_config(args.random))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    prompts, params = workload(args.num_seqs)
    longest = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, prompt in enumerate(prompts):  # left padding
        input_ids[i, longest - len(prompt) :] = torch.tensor(prompt)
        attention_mask[i, longest - len(prompt) :] = 1
    max_new = max(p.max_tokens for p in params)
    kwargs = dict(
        do_sample=True,
        temperature=0.6,
        top_p=1.0,
        top_k=0,
        max_new_tokens=max_new,
        eos_token_id=None,
        pad_token_id=0,
        max_time=args.max_time,
    )
    with torch.no_grad():
        model.generate(
            input_ids[:2, -16:].cuda(),
            attention_mask=attention_mask[:2, -16:].cuda(),
            **(kwargs | dict(max_new_tokens=4, max_time=None)),
        )  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(input_ids.cuda(), attention_mask=attention_mask.cuda(), **kwargs)
        torch.cuda.synchronize()
        t = time.perf_counter() - t
    steps = out.shape[1] - longest
    done = sum(min(p.max_tokens, steps) for p in params)
    total = sum(p.max_tokens for p in params)
    print(
        f"transformers {transformers.__version__} attn={model.config._attn_implementation} "
        f"model=random:{args.random} "
        f"experts={getattr(model.config, '_experts_implementation', None)} "
        f"requests={len(prompts)} steps={steps} of {max_new}"
    )
    print(f"Total: {done}tok of {total}, Time: {t:.2f}s, Throughput: {done / t:.2f}tok/s")
    print(f"memory peak allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
