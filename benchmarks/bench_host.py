"""The host's share of bench.py's workload: the engine's own Python (request checks, scheduling,
step inputs, resolving tokens, outputs) with the device's work taken away.

The model's forward and the sampler are replaced by stubs that return at once (random token ids),
so what is timed is everything the host does around them, on any machine, CPU included: the time
from ``generate``'s call to the first forward ("lead": the GPU would wait for it), the time per
step, and the time after the last forward ("tail"). With async scheduling, a step's host time
hides behind the device's as long as it is shorter.

    python bench_host.py                # tiny random model on the CPU, eager
    python bench_host.py --profile      # and the cProfile of the timed generate (top 25 by cumulative time)
"""
import argparse
import cProfile
import pstats
import statistics
import tempfile
import time

import torch

from bench import workload
from nanovllm import LLM
from nanovllm.engine import model_runner
from nanovllm.engine.step_output import StepOutput
from nanovllm.layers.sampler import SamplerOutput
from nanovllm.utils.checkpoint import make_random_checkpoint


def stub_device_work(stamps: list[float]) -> None:
    """Make every step's forward a no-op that records when it was called, and sampling a draw of
    random ids."""

    def run_model(self, input_ids, positions, context):
        stamps.append(time.perf_counter())

    def sample(self, seqs, logits):
        return StepOutput(seqs, SamplerOutput(torch.randint(0, 10000, (len(seqs),))), self.wait_event)

    model_runner.ModelRunner.run_model = run_model
    model_runner.ModelRunner.sample = sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="print the cProfile of the timed generate")
    args = parser.parse_args()
    stamps: list[float] = []
    stub_device_work(stamps)
    with tempfile.TemporaryDirectory(prefix="nanovllm-host-") as tmp:
        path = make_random_checkpoint(tmp, "tiny", dtype=torch.float32)
        with LLM(path, enforce_eager=True, max_model_len=4096) as llm:
            prompts, params = workload(256)
            llm.generate(prompts[:2], params[:2], use_tqdm=False)
            stamps.clear()
            profile = cProfile.Profile() if args.profile else None
            start = time.perf_counter()
            if profile:
                profile.enable()
            llm.generate(prompts, params, use_tqdm=False)
            if profile:
                profile.disable()
            end = time.perf_counter()
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    print(f"host time {end - start:.3f} s over {len(stamps)} steps; lead {stamps[0] - start:.4f} s, "
          f"tail {end - stamps[-1]:.4f} s")
    quarter = len(steps) // 4
    for i in range(4):
        part = steps[i * quarter : (i + 1) * quarter if i < 3 else len(steps)]
        print(f"steps {i * quarter + 1}-{i * quarter + len(part)}: median {statistics.median(part) * 1e3:.2f} ms, "
              f"max {max(part) * 1e3:.2f} ms")
    if profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
