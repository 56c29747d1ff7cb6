def head_dim(config) -> int:  # given (Qwen3), else hidden_size / heads
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_layers(config) -> int:  # all but a hybrid model's linear-attention layers (layer_types)
    types = list(getattr(config, "layer_types", None) or ())
    return config.num_hidden_layers - types.count("linear_attention")
