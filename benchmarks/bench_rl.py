"""What RL rollouts and batch jobs pay for: ``update_weights``, sleep and wake-up, structured
outputs.

    python benchmarks/bench_rl.py --random qwen3-8b --parts update,sleep      # one GPU
    python benchmarks/bench_rl.py --random qwen3-0.6b --parts structured

update: every tensor of the checkpoint, already in GPU memory in bfloat16 (as a trainer holds
    them), through ``update_weights``; the median of ``--repeats`` calls and the rate in GB/s.
sleep: ``sleep(1)`` / ``wake_up()`` twice (the first pins the host buffer, the second reuses it)
    and ``sleep(2)`` / ``wake_up()`` + ``update_weights`` (the weights from pinned host memory),
    each timed, with the device memory in use while asleep against the CUDA context with cuBLAS
    loaded (measured before the engine starts), and the greedy tokens of a small batch compared
    with those before.
structured: ``bench.py``'s prompts (``--num-seqs``) at temperature 1 as JSON of a small schema
    (compact whitespace, at most ``--max-tokens``), against the same prompts unconstrained with each
    request's ``max_tokens`` set to the length its JSON took (ignore_eos): the same prefill and
    decode tokens, with and without the grammar; twice each, alternating.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import workload  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.checkpoint import (
    make_random_checkpoint,
    model_config,
    weight_bytes,
    weight_shapes,
)  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer"},
    },
    "required": ["label", "score"],
}
GIB = 2**30


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def gpu_weights(shape: str, seed: int) -> dict[str, torch.Tensor]:
    """The shape's checkpoint tensors drawn on the GPU in bfloat16 (a trainer's state_dict)."""
    torch.manual_seed(seed)
    return {
        name: torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 0.02
        for name, s in weight_shapes(model_config(shape)).items()
    }


def part_update(path: str, shape: str, repeats: int, engine: dict) -> None:
    weights = gpu_weights(shape, 1)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    with LLM(path, **engine) as llm:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.update_weights(weights.items())
            times.append(time.perf_counter() - t)
        out = llm.generate(
            ["Update check: "], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )
    med = statistics.median(times)
    print(
        f"update_weights {shape}: {len(weights)} tensors, {nbytes / GIB:.2f} GiB from GPU memory: "
        f"median {med:.3f} s ({nbytes / med / 1e9:.0f} GB/s) "
        f"of {', '.join(f'{x:.3f}' for x in times)}; "
        f"then generated {len(out[0]['token_ids'])} tokens"
    )


def part_sleep(path: str, shape: str, engine: dict) -> None:
    x = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    (
        x @ x
    ).sum().item()  # the CUDA context with cuBLAS loaded, as any process that multiplies has it
    context = device_used()
    prompts = [[(31 * i + 7 * n) % 10000 for i in range(n)] for n in (300, 50, 900, 17)]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    host = {name: t.cpu().pin_memory() for name, t in gpu_weights(shape, 2).items()}
    torch.cuda.empty_cache()
    with LLM(path, enable_sleep_mode=True, **engine) as llm:
        llm.update_weights(host.items())  # weights with known values, to send again after level 2
        before = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        awake = device_used()
        rows = []
        for level in (1, 1, 2):  # the first sleep(1) pins the host buffer, the second reuses it
            t = time.perf_counter()
            llm.sleep(level)
            t_sleep = time.perf_counter() - t
            asleep, reserved = device_used(), torch.cuda.memory_reserved()
            t = time.perf_counter()
            llm.wake_up()
            if level == 2:
                llm.update_weights(host.items())
            t_wake = time.perf_counter() - t
            after = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
            rows.append((level, t_sleep, t_wake, asleep, reserved, after == before))
    print(
        f"sleep {shape}: CUDA context (cuBLAS loaded) {context / GIB:.2f} GiB; "
        f"awake {awake / GIB:.2f} GiB in use"
    )
    for level, t_sleep, t_wake, asleep, reserved, same in rows:
        wake = "wake_up + update_weights from pinned host memory" if level == 2 else "wake_up"
        print(
            f"  level {level}: sleep {t_sleep:.2f} s, {wake} {t_wake:.2f} s; "
            f"asleep {asleep / GIB:.2f} GiB in use, "
            f"{(asleep - context) / GIB:.2f} GiB beyond the context "
            f"(torch reserves {reserved / GIB:.2f} GiB); "
            f"greedy tokens as before: {same}"
        )


def part_structured(path: str, num_seqs: int, max_tokens: int, engine: dict) -> None:
    from nanovllm import StructuredOutputsParams

    prompts, _ = workload(num_seqs)
    json_params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    constrained = SamplingParams(
        temperature=1.0, max_tokens=max_tokens, seed=0, structured_outputs=json_params
    )
    with LLM(path, **engine) as llm:
        outs = llm.generate(prompts, constrained, use_tqdm=False)  # also compiles the grammar
        lengths = [len(o["token_ids"]) for o in outs]
        free = [
            SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=0) for n in lengths
        ]
        times = {}
        for name, params in (("unconstrained", free), ("json", constrained)) * 2:
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.setdefault(name, []).append(time.perf_counter() - t)
            assert [len(o["token_ids"]) for o in outs] == lengths  # the same tokens (seeded)
    stops = sum(o["finish_reason"] == "stop" for o in outs)
    print(
        f"structured: {num_seqs} requests, {sum(lengths)} tokens (longest {max(lengths)}; "
        f"{stops} JSON completions ended by the grammar)"
    )
    for name, runs in times.items():
        print(f"  {name}: " + ", ".join(f"{t:.3f} s" for t in runs))
    ratio = statistics.median(times["json"]) / statistics.median(times["unconstrained"])
    print(f"  json / unconstrained (medians): {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--random", metavar="SHAPE", default="qwen3-8b")
    parser.add_argument("--parts", default="update,sleep,structured")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="leaves room for the tensors this script holds in GPU memory itself",
    )
    args = parser.parse_args()
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory(prefix="nanovllm-rl-") as tmp:
        dummy = weight_bytes(model_config(args.random)) > 8 * GIB
        path = make_random_checkpoint(tmp, args.random, dtype=torch.bfloat16, weights=not dummy)
        engine = dict(gpu_memory_utilization=args.gpu_memory_utilization)
        if dummy:
            engine["load_format"] = "dummy"
        if "update" in parts:
            part_update(path, args.random, args.repeats, engine)
        if "sleep" in parts:
            part_sleep(path, args.random, engine)
        if "structured" in parts:
            part_structured(path, args.num_seqs, args.max_tokens, engine)


if __name__ == "__main__":
    main()
