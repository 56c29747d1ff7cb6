"""Checks of tensor_parallel_size and data_parallel_size against the model and the GPUs."""

TP_SPLIT_KEYS = ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size")


def check_parallel(config, device: str) -> None:
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    for name in TP_SPLIT_KEYS:  # KV heads may instead be fewer than ranks: then replicated
        value = getattr(config.hf_config, name, None) or tp  # none: Qwen3.5-MoE, no dense MLP
        if value % tp and (name != "num_key_value_heads" or tp % value):
            msg = f"must divide the model's {name} ({value})"
            raise ValueError(f"Config.tensor_parallel_size={tp} {msg}")
    if device == "cuda" and config.data_parallel_backend == "mp":
        import torch

        visible = torch.cuda.device_count()
        if tp * dp > visible:
            need = f"tensor_parallel_size={tp}"
            need = need if dp == 1 else f"data_parallel_size={dp} × {need}"
            msg = f"needs {tp * dp} GPUs, but only {visible} GPU(s) are visible"
            raise ValueError(f"Config.{need} {msg}")
