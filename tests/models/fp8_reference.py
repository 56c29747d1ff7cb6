"""An independent W8A8 reference for FP8 checkpoints: Hugging Face transformers (float32) on the
block-dequantized weights, every decoder projection (and each MoE expert's) fed activations that
are quantized per token and group of 128 channels and dequantized again. Written from the format's
definition, without the library's quantization code."""

import os
import shutil

import torch
import torch.nn.functional as F
from hf_reference import edit_json
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] (multiples of 128) -> (e4m3 values, float32 [out/128, in/128] scales)."""
    out_features, in_features = w.shape
    blocks = (
        w.float().reshape(out_features // 128, 128, in_features // 128, 128).permute(0, 2, 1, 3)
    )
    scale = blocks.abs().amax(dim=(-1, -2)) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale[..., None, None]).clamp(-448.0, 448.0).to(E4M3)
    return q.permute(0, 2, 1, 3).reshape(out_features, in_features), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    expanded = torch.kron(scale, torch.ones(128, 128))[: q.shape[0], : q.shape[1]]
    return q.float() * expanded


def fake_quant_groups(x: torch.Tensor) -> torch.Tensor:
    """x [..., k] (k a multiple of 128) through e4m3 per group of 128: quantized, then
    dequantized."""
    groups = x.float().unflatten(-1, (-1, 128))
    scale = groups.abs().amax(dim=-1, keepdim=True) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((groups / scale).clamp(-448.0, 448.0).to(E4M3).float() * scale).flatten(-2)


def write_fp8_from(src: str, dst: str) -> str:
    """Copy checkpoint ``src`` (float) to ``dst`` in Qwen's FP8 format, quantized here."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = quantize_blocks(t)
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"))
    edit_json(
        dst,
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    )
    return dst


def write_dequantized(src: str, dst: str) -> str:
    """Copy FP8 checkpoint ``src`` to ``dst`` in float32, each weight times its block scales."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {
        name: dequantize_blocks(t, tensors[name + "_scale_inv"])
        if name + "_scale_inv" in tensors
        else t.float()
        for name, t in tensors.items()
        if not name.endswith("_scale_inv")
    }
    save_file(out, os.path.join(dst, "model.safetensors"))
    edit_json(dst, quantization_config=None, torch_dtype="float32")
    return dst


def _quantized_linear(module):
    return lambda x: F.linear(fake_quant_groups(x), module.weight, module.bias)


def _quantized_experts(module):
    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for k in range(top_k_index.shape[1]):
                e = int(top_k_index[t, k])
                gate, up = F.linear(
                    fake_quant_groups(hidden_states[t]), module.gate_up_proj[e]
                ).chunk(2)
                h = F.silu(gate) * up
                out[t] += top_k_weights[t, k] * F.linear(fake_quant_groups(h), module.down_proj[e])
        return out

    return forward


def load_reference(dequantized: str, activations: bool = True):
    """The transformers model of ``dequantized``; with ``activations``, its decoder projections
    quantize their inputs per token and 128 channels (the LM head and the MoE routers do not)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        dequantized, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if activations:
        for name, module in model.model.layers.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("mlp.gate"):
                module.forward = _quantized_linear(module)
            elif type(module).__name__.endswith("Experts"):
                module.forward = _quantized_experts(module)
    return model


def reference_logprobs(
    model, prompt: list[int], tokens: list[int]
) -> tuple[list[float], list[int], list[float]]:
    """Teacher-forced on ``prompt + tokens``: at each generated position, the log-probability of
    ``tokens[j]``, the reference's argmax and its top-2 logit gap."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    logp = torch.log_softmax(logits, dim=-1)
    top = logits.topk(2, dim=-1).values
    return (
        [float(logp[j, t]) for j, t in enumerate(tokens)],
        logits.argmax(-1).tolist(),
        (top[:, 0] - top[:, 1]).tolist(),
    )
