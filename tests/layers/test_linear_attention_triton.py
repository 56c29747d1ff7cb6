"""The Gated DeltaNet Triton kernels (``triton_ops.py``, ``gpu_step.py``) against the torch ops of
``ops.py`` under the Triton interpreter (one subprocess: this file run as a script), at tiny sizes:
one step of sequences of uneven lengths (1 and 2: shorter than the conv window; 0: skipped),
fresh and continued, their slots in arbitrary order, a row no sequence covers, and decode-graph
padding (rows on the spare slot, fresh). float32 within 2e-5 (the torch delta rule runs in
chunks, the kernel token by token); bf16 inputs within a rounding step of bf16 outputs (4e-3
relative), the float32 states within 2e-5. The GPU file tests/gpu/test_gpu_qwen3_5.py runs the
same checks on a GPU (``check_step``)."""

import pytest
import torch
from triton_interpreter import (
    results_under_interpreter,
    round_interpreter_casts_to_nearest,
    run_cases,
    squeeze_interpreter_loop_bounds,
)

from nanovllm.layers.linear_attention.states import StateBatch

DIMS = (2, 4, 16, 32, 4)  # Hk, Hv, Dk, Dv, W
# (length, slot, fresh): the slots out of order, the spare slot 7 for two padding rows
STEP = [(5, 3, True), (1, 0, False), (2, 5, False), (0, 2, False), (9, 1, False), (1, 6, True)]
PADDED = [(1, 7, True), (1, 7, True)]


def make_step(seed: int, dtype: torch.dtype, step=STEP, device="cpu", dims=DIMS, extra_rows=1):
    """Inputs of one step: the rows of ``step`` in order, then ``extra_rows`` no sequence covers;
    states in 8 slots."""
    from nanovllm.layers.linear_attention.ops import decay_and_beta

    HK, HV, DK, DV, W = dims
    C = 2 * HK * DK + HV * DV
    gen = torch.Generator().manual_seed(seed)
    lens = [n for n, _, _ in step]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    t = sum(lens) + extra_rows
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    a_log = torch.empty(HV).uniform_(0.01, 4, generator=gen).log()
    s = dict(mixed=rnd(t, C), weight=rnd(C, W) * 0.5, z=rnd(t, HV * DV), a=rnd(t, HV), b=rnd(t, HV))
    s |= dict(a_log=a_log, dt_bias=torch.rand(HV, generator=gen), norm_w=1 + 0.1 * rnd(DV))
    s |= dict(conv=rnd(8, C, W - 1), rec=rnd(8, HV, DK, DV) * 0.3)
    s = {k: v.to(dtype) if k not in ("rec", "a_log", "dt_bias") else v for k, v in s.items()}
    s["g"], s["beta"] = decay_and_beta(s["a"], s["b"], s["a_log"], s["dt_bias"])
    rows = [starts, lens, [slot for _, slot, _ in step], [int(f) for _, _, f in step]]
    s["tensors"] = torch.tensor(rows, dtype=torch.int32)
    s["host"] = (starts, lens, rows[2], [f for _, _, f in step])
    s["dims"] = dims
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in s.items()}


def reference(s: dict) -> dict:
    """ops.py per sequence on copies of the states."""
    from nanovllm.layers.linear_attention import ops

    HK, HV, DK, DV, _ = s["dims"]
    conv, rec = s["conv"].clone(), s["rec"].clone()
    x, out = s["mixed"].clone(), torch.zeros(s["mixed"].shape[0], HV, DV, dtype=s["mixed"].dtype)
    out = out.to(s["mixed"].device)
    for start, n, slot, fresh in zip(*s["host"]):
        if n == 0 or slot == 7:  # the spare slot's rows (padding) are not checked
            continue
        r = slice(start, start + n)
        x[r] = ops.causal_conv(s["mixed"][r], s["weight"], conv[slot], fresh)
        q, k, v = x[r].split([HK * DK, HK * DK, HV * DV], dim=-1)
        q, k, v = q.reshape(n, HK, DK), k.reshape(n, HK, DK), v.reshape(n, HV, DV)
        out[r] = ops.gated_delta_rule(q, k, v, s["g"][r], s["beta"][r], rec[slot], fresh)
    t = out.shape[0]
    normed = ops.gated_rms_norm(
        out.reshape(t * HV, DV), s["z"].reshape(t * HV, DV), s["norm_w"], 1e-6
    )
    return dict(x=x, out=out, normed=normed.reshape(t, HV * DV), conv=conv, rec=rec)


def kernels(s: dict, gate: bool) -> dict:
    from nanovllm.layers.linear_attention.gpu_step import gated_rms_norm_triton
    from nanovllm.layers.linear_attention.triton_ops import causal_conv_varlen, delta_rule_varlen

    HK, HV, DK, DV, _ = s["dims"]
    conv, rec = s["conv"].clone(), s["rec"].clone()
    rows = tuple(s["tensors"])
    x = causal_conv_varlen(s["mixed"], s["weight"], conv, *rows, max(s["host"][1]))
    t = x.shape[0]
    q, k, v = x.split([HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.view(t, HK, DK), k.view(t, HK, DK), v.view(t, HV, DV)
    if gate:
        g, beta, pair = s["a"], s["b"], (s["a_log"], s["dt_bias"])
    else:
        g, beta, pair = s["g"], s["beta"], None
    out = delta_rule_varlen(q, k, v, g, beta, rec, *rows, gate=pair)
    z = s["z"].reshape(t * HV, DV)
    normed = gated_rms_norm_triton(out.reshape(t * HV, DV), z, s["norm_w"], 1e-6)
    return dict(x=x, out=out, normed=normed.reshape(t, HV * DV), conv=conv, rec=rec)


def compare(got: dict, want: dict, s: dict) -> dict:
    """The largest difference of each output over the checked rows and slots."""
    rows = torch.zeros(got["x"].shape[0], dtype=torch.bool)
    covered = rows.clone()
    for start, n, slot, _ in zip(*s["host"]):
        covered[start : start + n] = True
        if slot != 7:
            rows[start : start + n] = True
    slots = [slot for slot in range(8) if slot != 7]
    diff = {}
    for name in got:
        a, b = got[name].cpu().double(), want[name].cpu().double()
        a, b = (a[slots], b[slots]) if name in ("conv", "rec") else (a[rows], b[rows])
        diff[name] = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
    diff["uncovered_out_zero"] = bool((got["out"].cpu()[~covered] == 0).all())
    diff["spare_finite"] = bool(got["rec"][7].isfinite().all() and got["conv"][7].isfinite().all())
    return diff


def check_step(dtype=torch.float32, gate=True, step=STEP, device="cpu", seed=0, dims=DIMS):
    s = make_step(seed, dtype, step, device, dims)
    return compare(kernels(s, gate), reference(s), s)


def check_layer(dtype=torch.float32) -> dict:  # bf16: the GPU tests
    """A whole GatedDeltaNet layer: ``gpu_step.mix_step`` (the kernels) and its torch path, on
    copies of the same states, over STEP."""
    from types import SimpleNamespace

    from nanovllm.layers.linear_attention.gpu_step import mix_step
    from nanovllm.layers.linear_attention.layer import GatedDeltaNet
    from nanovllm.layers.linear_attention.states import state_batch

    hk, hv, dk, dv, w = DIMS
    config = SimpleNamespace(hidden_size=48, linear_num_key_heads=hk, linear_num_value_heads=hv,
                             linear_key_head_dim=dk, linear_value_head_dim=dv,
                             linear_conv_kernel_dim=w, rms_norm_eps=1e-6)  # fmt: skip
    torch.manual_seed(3)
    layer = GatedDeltaNet(config)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.normal_(0.0, 0.3 if param.dim() > 1 else 0.1)
            if name == "A_log":
                param.uniform_(-2, 1)
    layer = layer.to(dtype)
    s = make_step(4, dtype)
    hidden = torch.randn(s["mixed"].shape[0], 48).to(dtype)
    batch = StateBatch(*s["host"], tensors=s["tensors"], max_len=max(s["host"][1]))
    conv, rec = s["conv"], s["rec"]
    layer.conv_states, layer.recurrent_states = conv.clone(), rec.clone()
    with torch.no_grad(), state_batch(StateBatch(*s["host"])):
        want = layer(hidden)
    want_states = layer.conv_states, layer.recurrent_states
    layer.conv_states, layer.recurrent_states = conv.clone(), rec.clone()
    with torch.no_grad():
        got = layer.out_proj(mix_step(layer, *layer.project(hidden), batch))
    diff = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
    return {
        "out": diff(got, want) / want.abs().max().item(),
        "conv": diff(layer.conv_states, want_states[0]),
        "rec": diff(layer.recurrent_states, want_states[1]),
    }


INTERPRETER_CASES = {
    "float32_gate": lambda: check_step(),
    "float32_g_beta": lambda: check_step(gate=False, step=[(2, 1, True), (3, 0, False)], seed=1),
    "bf16_gate": lambda: check_step(torch.bfloat16, seed=2),
    "float32_padded_decode": lambda: check_step(step=[(1, 4, False), (1, 2, True)] + PADDED),
    "layer_float32": lambda: check_layer(),
}


def tolerance(name: str, case: str) -> float:
    if "bf16" in case and name in ("x", "out", "normed", "conv"):
        return 8e-3 if name != "conv" else 0.0  # bf16 outputs; the window is copied exactly
    if "bf16" in case and name == "rec":  # float32 state from bf16 inputs (1.3e-4 at Dk = 128)
        return 5e-4
    return 2e-5 if name != "conv" else 0.0


def run_interpreter_cases() -> dict:
    """Runs in the subprocess, with TRITON_INTERPRET=1 already in the environment."""
    squeeze_interpreter_loop_bounds()
    round_interpreter_casts_to_nearest()
    return run_cases(INTERPRETER_CASES)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_kernels_match_torch_ops_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    assert "error" not in result, result["error"]
    if case.startswith("layer"):
        assert result["out"] <= 2e-5, result
        assert result["conv"] == 0 and result["rec"] <= 2e-5, result
        return
    for name in ("x", "out", "normed", "conv", "rec"):
        assert result[name] <= tolerance(name, case), (name, result)
    assert result["uncovered_out_zero"] and result["spare_finite"], result


def test_decode_rows_pad_on_the_spare_slot():
    """StateRunner's graphed decode step: slots and fresh of its rows, then padding (spare, fresh),
    into the static rows the graphs read; a prefill step gets its own rows and cu_seqlens."""
    from types import SimpleNamespace

    from nanovllm.runner.state_runner import StateRunner

    runner = SimpleNamespace(spare=8, graphs=SimpleNamespace(padded_batch=lambda n: 4))
    runner._tensor = lambda data, dtype: torch.tensor(data, dtype=dtype)
    runner.decode_rows = torch.tensor([list(range(8)), [1] * 8, [8] * 8, [1] * 8]).int()
    step = SimpleNamespace(num_seqs=3, is_prefill=False)
    batch = StateBatch([0, 1, 2], [1, 1, 1], [5, 0, 3], [False, False, False])
    StateRunner._send(runner, step, batch)
    assert batch.tensors is runner.decode_rows and batch.max_len == 1
    assert runner.decode_rows[2:, :5].tolist() == [[5, 0, 3, 8, 8], [0, 0, 0, 1, 1]]
    prefill = StateBatch([0, 4], [4, 2], [1, 2], [True, False])
    StateRunner._send(runner, SimpleNamespace(num_seqs=2, is_prefill=True), prefill)
    assert prefill.tensors.tolist() == [[0, 4], [4, 2], [1, 2], [1, 0]] and prefill.max_len == 4
    assert prefill.cu_seqlens.tolist() == [0, 4, 6] == prefill.cu_seqlens_cpu.tolist()


if __name__ == "__main__":
    import json

    print(json.dumps(run_interpreter_cases()))
