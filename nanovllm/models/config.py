"""Values derived from a Hugging Face model config that several modules need."""


def head_dim(config) -> int:
    """``head_dim`` from the config when present (Qwen3 sets it explicitly), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
