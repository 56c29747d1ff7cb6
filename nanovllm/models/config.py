def head_dim(config) -> int:  # given (Qwen3), else hidden_size / heads
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
