"""The memory floor of ``bench.py``'s workload: the bytes its decode steps must read from device
memory, and the time that takes at a given bandwidth.

Every decode step reads each weight it uses once and the KV cache of every running sequence (a
hybrid model's full-attention layers only; its linear-attention layers read and write each
sequence's recurrent states once). The
model assumed here is the one ``bench.py`` runs when the cache holds every request at once: all
256 prompts are prefilled first, then step t decodes every request with more than t + 1 output
tokens, over its prompt plus t + 1 tokens of context. A Qwen3-MoE layer reads only the experts its
tokens are routed to; with B tokens of top-k routing among E experts, spread uniformly (as random
weights route), E * (1 - (1 - k/E)^B) experts are expected. Not counted: prefill, the embedding rows
looked up (an untied embedding matrix is not read whole), activations and the sampler.

    python benchmarks/bench_floor.py --shape qwen3-30b-a3b --bandwidth 4.3   # TB/s
    # the bandwidth from a device copy (GPU):
    python benchmarks/bench_floor.py --shape qwen3-0.6b --measure
    # FP8 weights:
    python benchmarks/bench_floor.py --shape qwen3-8b --quantization fp8 --bandwidth 3.35
    # Qwen3-8B's shape:
    python benchmarks/bench_floor.py --shape qwen3-4b --set hidden_size=4096 \
        --set intermediate_size=12288 --set num_attention_heads=32 --bandwidth 3.06

Run it from the repository root as ``python benchmarks/bench_floor.py ...``. It imports ``bench``
(``bench.py``'s workload) through the repository root, which the first lines below put on
``sys.path``; tools of this folder import each other by their plain names (a script's own
folder is on ``sys.path``).
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.py

from bench import workload  # noqa: E402
from nanovllm.utils.checkpoint import model_config, tensor_bytes  # noqa: E402


def weight_bytes_by_kind(
    config: dict, itemsize: int = 2, quantization: str | None = None
) -> tuple[int, int]:
    """(bytes of all experts of all MoE layers, bytes every decode step reads whatever its batch:
    all other weights, the LM head included, an untied input embedding not). With
    ``quantization="fp8"`` a quantized weight counts 1 byte a value plus its float32 block
    scales."""
    expert, dense = 0, 0
    for name, size in tensor_bytes(config, itemsize, quantization).items():
        if ".experts." in name:
            expert += size
        elif name != "model.embed_tokens.weight" or config["tie_word_embeddings"]:
            dense += size
    return expert, dense


def state_bytes(config: dict) -> int:
    """Bytes of one sequence's recurrent states over a hybrid model's linear-attention layers
    (``layer_types``): the float32 delta-rule state and the bf16 convolution window; 0 else."""
    layers = (config.get("layer_types") or []).count("linear_attention")
    if not layers:
        return 0
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    window = (2 * hk * dk + hv * dv) * (config["linear_conv_kernel_dim"] - 1) * 2
    return layers * (hv * dk * dv * 4 + window)


def step_bytes(
    config: dict,
    contexts: list[int],
    kv_bytes_per_token_head: float,
    by_kind: tuple[int, int] | None = None,
) -> tuple[float, float, float]:
    """(weight bytes, KV bytes, state bytes) one decode step moves for a batch of these context
    lengths. ``kv_bytes_per_token_head``: what the cache stores of one token and KV head, K and V
    together (bf16: 4 * head_dim; FP8: 2 * head_dim plus two 4-byte scales); KV only in the
    full-attention layers of a hybrid model, whose recurrent states are read and written once
    each. ``by_kind``: the config's ``weight_bytes_by_kind``, if already computed."""
    expert, dense = by_kind or weight_bytes_by_kind(config)
    if expert:  # every MoE layer reads the same expected share of its experts
        experts, k = config["num_experts"], config["num_experts_per_tok"]
        dense += expert * (1 - (1 - k / experts) ** len(contexts))
    kinds = config.get("layer_types")
    layers = kinds.count("full_attention") if kinds else config["num_hidden_layers"]
    kv = sum(contexts) * layers * config["num_key_value_heads"] * kv_bytes_per_token_head
    return dense, kv, 2 * len(contexts) * state_bytes(config)


def workload_floor(
    config: dict, num_seqs: int, kv_bytes_per_token_head: float, quantization: str | None = None
) -> tuple[float, float, float, int]:
    """(weight, KV, state bytes) over all decode steps of the workload, and the number of
    steps."""
    prompts, params = workload(num_seqs)
    by_kind = weight_bytes_by_kind(config, quantization=quantization)
    weights = kv = state = 0.0
    # the first token of each request comes from its prefill
    steps = max(p.max_tokens for p in params) - 1
    for t in range(steps):
        contexts = [
            len(prompt) + t + 1 for prompt, p in zip(prompts, params) if p.max_tokens > t + 1
        ]
        w, c, r = step_bytes(config, contexts, kv_bytes_per_token_head, by_kind)
        weights, kv, state = weights + w, kv + c, state + r
    return weights, kv, state, steps


def measured_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy (read + written), median of 10."""
    import statistics

    import torch

    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--bandwidth", type=float, default=None, help="TB/s")
    parser.add_argument(
        "--measure", action="store_true", help="measure the bandwidth with a device copy"
    )
    parser.add_argument(
        "--kv-bytes",
        type=float,
        default=0,
        help="K+V bytes per token and KV head (default bf16: 4 * head_dim; FP8: 2 * head_dim + 8)",
    )
    parser.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="FP8 weights: 1 byte a weight plus a float32 scale per 128x128 block",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config.json field of the shape (an integer), repeatable",
    )
    args = parser.parse_args()
    if any(not re.fullmatch(r"\w+=\d+", item) for item in args.set):
        parser.error(f"--set takes KEY=INTEGER, got {args.set}")
    config = model_config(
        args.shape, **{k: int(v) for k, v in (item.split("=") for item in args.set)}
    )
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_head = args.kv_bytes or 4 * head_dim
    prompts, params = workload(args.num_seqs)
    full = [len(p) + 1 for p in prompts]
    by_kind = weight_bytes_by_kind(config, quantization=args.quantization)
    w1, kv1, state1 = step_bytes(config, full, per_head, by_kind)
    weights, kv, state, steps = workload_floor(config, args.num_seqs, per_head, args.quantization)
    tokens = sum(p.max_tokens for p in params)
    shape = " ".join([args.shape] + args.set + ([args.quantization] if args.quantization else []))
    print(
        f"{shape}: first decode step ({len(full)} sequences): weights {w1 / 1e9:.2f} GB, "
        f"KV {kv1 / 1e9:.2f} GB" + (f", states {state1 / 1e9:.2f} GB" if state1 else "")
    )
    print(
        f"{steps} decode steps: weights {weights / 1e12:.2f} TB, KV {kv / 1e12:.2f} TB, "
        + (f"states {state / 1e12:.2f} TB, " if state else "")
        + f"{tokens} output tokens"
    )
    bandwidth = measured_bandwidth() if args.measure else (args.bandwidth or 0) * 1e12
    if bandwidth:
        floor = (weights + kv + state) / bandwidth
        print(
            f"at {bandwidth / 1e12:.2f} TB/s: decode floor {floor:.2f} s, "
            f"{tokens / floor:,.0f} tok/s"
        )


if __name__ == "__main__":
    main()
