"""Gated DeltaNet delta-rule kernels on a GPU at a Qwen3.5 layer's shape (16 key / 32 value heads,
Dk = Dv = 128): the recurrent Triton kernel (``triton_ops.delta_rule_varlen``) and fla-core's
chunked kernel (when it imports) against the torch ops in float32 (largest difference), then
their times in bf16 for a prefill batch and a decode batch.

    python benchmarks/gdn_kernels.py [--prefill-seqs 64 --prefill-len 512 --decode-seqs 256]
"""

import argparse

import torch
import triton

from nanovllm.layers.linear_attention import ops
from nanovllm.layers.linear_attention.gpu_step import delta_rule_chunked_fla, fla_chunked
from nanovllm.layers.linear_attention.states import StateBatch
from nanovllm.layers.linear_attention.triton_ops import causal_conv_varlen, delta_rule_varlen

HK, HV, DK, DV = 16, 32, 128, 128


def make(num_seqs: int, length: int, dtype: torch.dtype, fresh: bool, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = num_seqs * length
    rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    q, k = rnd(t, HK, DK).to(dtype), rnd(t, HK, DK).to(dtype)
    v = rnd(t, HV, DV).to(dtype)
    a_log = torch.empty(HV, device="cuda").uniform_(0.01, 4, generator=gen).log()
    g, beta = ops.decay_and_beta(rnd(t, HV), rnd(t, HV), a_log, torch.rand(HV, device="cuda"))
    states = rnd(num_seqs + 1, HV, DK, DV) * 0.1
    starts = list(range(0, t, length))
    slots = list(range(num_seqs))[::-1]  # out of order
    rows = [starts, [length] * num_seqs, slots, [int(fresh)] * num_seqs]
    batch = StateBatch(starts, [length] * num_seqs, slots, [fresh] * num_seqs)
    batch.tensors = torch.tensor(rows, dtype=torch.int32, device="cuda")
    batch.max_len = length
    batch.cu_seqlens_cpu = torch.arange(0, t + 1, length, dtype=torch.int64)
    batch.cu_seqlens = batch.cu_seqlens_cpu.cuda()
    return (q, k, v, g, beta, states), batch


def recurrent(inputs, batch):
    q, k, v, g, beta, states = inputs
    return delta_rule_varlen(q, k, v, g, beta, states, *batch.tensors)


def chunked(inputs, batch):
    return delta_rule_chunked_fla(*inputs, batch)


def torch_ops(inputs, batch):
    q, k, v, g, beta, states = inputs
    out = []
    for start, n, slot, fresh in zip(batch.starts, batch.lens, batch.slots, batch.fresh):
        r = slice(start, start + n)
        out.append(ops.gated_delta_rule(q[r], k[r], v[r], g[r], beta[r], states[slot], fresh))
    return torch.cat(out)


def max_diff(fn, num_seqs: int, length: int) -> str:
    inputs, batch = make(num_seqs, length, torch.float32, fresh=False, seed=1)
    ref_inputs = tuple(x.clone() for x in inputs)
    want = torch_ops(ref_inputs, batch)
    got = fn(inputs, batch)
    out = (got.float() - want).abs().max().item()
    state = (inputs[-1] - ref_inputs[-1]).abs().max().item()
    return f"out {out:.1e} state {state:.1e}"


def timed(fn, num_seqs: int, length: int) -> float:
    inputs, batch = make(num_seqs, length, torch.bfloat16, fresh=False)
    return triton.testing.do_bench(lambda: fn(inputs, batch), warmup=5, rep=50)


def conv_time(num_seqs: int, length: int) -> float:
    c = 2 * HK * DK + HV * DV
    t = num_seqs * length
    x = torch.randn(t, c, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(c, 4, device="cuda", dtype=torch.bfloat16)
    states = torch.zeros(num_seqs + 1, c, 3, device="cuda", dtype=torch.bfloat16)
    _, batch = make(num_seqs, length, torch.bfloat16, fresh=False)
    rows = tuple(batch.tensors)
    return triton.testing.do_bench(lambda: causal_conv_varlen(x, w, states, *rows, length))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-seqs", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-seqs", type=int, default=256)
    args = parser.parse_args()
    kernels = {"recurrent (Triton)": recurrent}
    if fla_chunked() is not None:
        kernels["chunked (fla-core)"] = chunked
    else:
        print("fla-core does not import: only the recurrent kernel")
    prefill = (args.prefill_seqs, args.prefill_len)
    decode = (args.decode_seqs, 1)
    print(f"{torch.cuda.get_device_name()}; Hk {HK}, Hv {HV}, Dk {DK}, Dv {DV}")
    print(f"{'kernel':<20} {'float32 vs torch ops (4 x 300)':<32} {'prefill ms':>10} "
          f"{'decode ms':>10}")  # fmt: skip
    for name, fn in kernels.items():
        diff = max_diff(fn, 4, 300)
        times = [timed(fn, *prefill)]
        times.append(timed(fn, *decode))
        print(f"{name:<20} {diff:<32} {times[0]:>10.3f} {times[1]:>10.3f}")
    print(f"prefill: {prefill[0]} x {prefill[1]} tokens, decode: {decode[0]} x 1, bf16 inputs")
    print(f"causal conv (Triton): prefill {conv_time(*prefill):.3f} ms, "
          f"decode {conv_time(*decode):.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
