"""Weight quantization: ``resolve_quantization`` decides and checks it before weights load."""

BLOCK_SIZE = [128, 128]


def checkpoint_quantization(hf_config) -> str | None:
    """ "fp8" for Qwen's block FP8 config, None without one; else ValueError."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"config.json: quantization_config.quant_method {method!r} is not supported "
            "(only 'fp8')"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(
            f"config.json: quantization_config.fmt {fmt!r} is not supported (only 'e4m3')"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"config.json: quantization_config.activation_scheme {scheme!r} is not supported "
            "(only 'dynamic': activations quantized per token and group of 128 channels)"
        )
    block = qc.get("weight_block_size")
    if list(block or []) != BLOCK_SIZE:
        raise ValueError(
            f"config.json: quantization_config.weight_block_size {block!r} is not supported "
            f"(only {BLOCK_SIZE})"
        )
    for module in qc.get("modules_to_not_convert") or []:
        # the LM head and the MoE routers are never quantized here; others are not supported
        if not (module == "lm_head" or module.endswith(".mlp.gate")):
            raise ValueError(
                f"config.json: quantization_config.modules_to_not_convert lists {module!r}; only "
                "'lm_head' and MoE routers ('*.mlp.gate') may stay unquantized"
            )
    return "fp8"


def resolve_quantization(
    quantization: str | None, hf_config, tensor_parallel_size: int, device: str
) -> str | None:
    """The checkpoint's quantization, else ``quantization``; ValueError for what cannot run."""
    resolved = checkpoint_quantization(hf_config) or quantization
    if resolved is None:
        return None
    if device == "cuda":
        import torch

        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            raise ValueError(
                f"FP8 weights need a GPU of compute capability 8.9 or newer, this one has "
                f"{capability[0]}.{capability[1]}; use a float checkpoint without "
                "quantization='fp8'"
            )
    check_fp8_shapes(hf_config, tensor_parallel_size)
    return resolved


def check_fp8_shapes(hf_config, tp: int) -> None:
    """ValueError unless every part of a fused FP8 layer and every TP shard is whole blocks."""
    from nanovllm.models.config import head_dim

    hd = head_dim(hf_config)
    sizes = [
        (
            "self_attn.q_proj output (num_attention_heads * head_dim)",
            hf_config.num_attention_heads * hd,
        ),
        (
            "self_attn.k_proj/v_proj output (num_key_value_heads * head_dim)",
            hf_config.num_key_value_heads * hd,
        ),
        (
            "mlp.gate_proj/up_proj output, mlp.down_proj input (intermediate_size)",
            hf_config.intermediate_size,
        ),
    ]
    if getattr(hf_config, "num_experts", 0):
        sizes.append(
            (
                "mlp.experts.*.gate_proj/up_proj output, down_proj input (moe_intermediate_size)",
                hf_config.moe_intermediate_size,
            )
        )
    for layer, size in sizes:
        if size % tp == 0 and (size // tp) % BLOCK_SIZE[0] == 0:
            continue
        if tp == 1:
            raise ValueError(
                f"FP8 weights: {layer} is {size}, not a multiple of 128; the fused layers pack "
                "their 128x128 scale blocks, so each part must be whole blocks"
            )
        raise ValueError(
            f"FP8 weights: {layer} is {size}, split over tensor_parallel_size={tp} into "
            f"{size / tp:g} per rank, not a multiple of 128: a shard boundary would fall inside "
            "a 128x128 scale block"
        )
