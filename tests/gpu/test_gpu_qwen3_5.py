"""Qwen3.5's Gated DeltaNet on a CUDA GPU (skipped without one). The Triton kernels against the
torch ops (the interpreter file's ``check_step``: uneven, fresh and continued sequences, slots out
of order, decode padding) in float32 and bf16, at the tiny test shape and at Qwen3.5's (Dk = Dv =
128, 16 key / 32 value heads); fla-core's chunked prefill where it imports. Then a tiny random
Qwen3.5 through the engine in float32, eager and with CUDA graphs, with the recurrent kernel or
fla for prefill: the same greedy tokens as the CPU torch path, log-probabilities within 1e-4
(fla, whose dots run in tf32: 1e-2)."""

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "gdn_triton_cases", Path(__file__).parents[1] / "layers" / "test_linear_attention_triton.py"
)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

QWEN35_DIMS = (16, 32, 128, 128, 4)
LONG = [(300, 3, True), (1, 0, False), (2, 5, False), (77, 1, False), (0, 2, False), (64, 6, True)]


@pytest.mark.parametrize("dims", [cases.DIMS, QWEN35_DIMS], ids=["tiny", "qwen3.5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("step", [cases.STEP, LONG, cases.STEP[:2] + cases.PADDED])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "g_beta"])
def test_kernels_match_torch_ops(dims, dtype, step, gate):
    result = cases.check_step(dtype, gate, step, "cuda", seed=len(step), dims=dims)
    case = "bf16" if dtype == torch.bfloat16 else "float32"
    for name in ("x", "out", "normed", "conv", "rec"):
        tol = cases.tolerance(name, case)
        if step is LONG and name != "conv":  # 300 tokens: the torch ops' chunks drift further
            tol = max(tol, 1e-4)
        assert result[name] <= tol, (name, result)
    assert result["uncovered_out_zero"] and result["spare_finite"], result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_fla_chunked_matches_torch_ops(dtype):
    from nanovllm.layers.linear_attention import ops
    from nanovllm.layers.linear_attention.gpu_step import delta_rule_chunked_fla, fla_chunked
    from nanovllm.layers.linear_attention.states import StateBatch

    if fla_chunked() is None:
        pytest.skip("fla-core does not import")
    hk, hv, dk, dv, _ = QWEN35_DIMS
    step = [(n, slot, fresh) for n, slot, fresh in LONG if n]  # fla: every row covered, in order
    s = cases.make_step(7, dtype, step, "cuda", QWEN35_DIMS, extra_rows=0)
    t = sum(n for n, _, _ in step)
    x = s["mixed"]
    q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv)
    rec = s["rec"].clone()
    cu = torch.tensor([0, *torch.tensor(s["host"][1]).cumsum(0).tolist()], dtype=torch.int64)
    batch = StateBatch(*s["host"], tensors=s["tensors"], max_len=300)
    batch.cu_seqlens, batch.cu_seqlens_cpu = cu.cuda(), cu
    got = delta_rule_chunked_fla(q, k, v, s["g"], s["beta"], rec, batch)
    want_rec = s["rec"].clone()
    for start, n, slot, fresh in zip(*s["host"]):
        r = slice(start, start + n)
        want = ops.gated_delta_rule(
            q[r], k[r], v[r], s["g"][r], s["beta"][r], want_rec[slot], fresh
        )
        tol = 2e-3 if dtype == torch.float32 else 2e-2  # fla's dots run in tf32 / bf16
        torch.testing.assert_close(got[r].float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(rec, want_rec, atol=tol, rtol=tol)


LAYERS = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
CONFIG = dict(
    vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=len(LAYERS),
    layer_types=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=513,
)  # fmt: skip


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    import os
    import shutil

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("this transformers has no Qwen3.5")
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from nanovllm.utils.checkpoint import TOKENIZER_DIR

    path = str(tmp_path_factory.mktemp("qwen3_5_gpu"))
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                param.normal_(0.0, 0.2 if param.dim() > 1 else 0.1)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), os.path.join(path, name))
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 3, 12, 17, 70, 130, 300, 5)]
    kwargs = dict(kvcache_block_size=256, max_model_len=512, attention_backend="triton")
    return path, prompts, generate(path, prompts, device="cpu", num_kvcache_blocks=16, **kwargs)


def generate(path, prompts, **kwargs) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    if kwargs.get("device") == "cpu":
        kwargs.pop("attention_backend")
    with LLM(path, dtype="float32", **kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (c.token_ids, [e[t].logprob for e, t in zip(c.logprobs, c.token_ids)])
        for c in (o.outputs[0] for o in outs)
    ]


@pytest.mark.parametrize("prefill", ["recurrent", "fla"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked7"])
def test_engine_matches_cpu_torch_path(qwen35, monkeypatch, prefill, enforce_eager, chunk):
    from nanovllm.layers.linear_attention import gpu_step

    if prefill == "fla" and gpu_step.fla_chunked() is None:
        pytest.skip("fla-core does not import")
    if prefill == "recurrent":
        monkeypatch.setattr(gpu_step, "FLA_MIN_LEN", 10**9)
    else:  # the engine keeps float32 models off fla (tf32 dots): here it is asked to use it
        monkeypatch.setattr(gpu_step, "FLA_DTYPES", (torch.float32,))
    path, prompts, cpu = qwen35
    extra = {} if chunk is None else dict(max_num_batched_tokens=chunk, max_model_len=512)
    kwargs = dict(kvcache_block_size=256, max_model_len=512, attention_backend="triton") | extra
    gpu = generate(path, prompts, enforce_eager=enforce_eager, max_num_seqs=16, **kwargs)
    for i, ((tokens, logprobs), (want, want_lp)) in enumerate(zip(gpu, cpu)):
        assert tokens == want, f"prompt {i}"
        tol = 1e-4 if prefill == "recurrent" else 1e-2  # fla: tf32 dots (5.5e-3 seen on an H100)
        assert logprobs == pytest.approx(want_lp, abs=tol), f"prompt {i}"
