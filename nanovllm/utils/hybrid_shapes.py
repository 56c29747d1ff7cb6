"""config.json of Qwen3.5's published sizes as text models (the language model's ``text_config``,
vision tower left out), for random checkpoints; their weights are drawn at load (dummy)."""

QWEN3_5_COMMON = dict(
    vocab_size=248320,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
    attention_bias=False,
    bos_token_id=248044,
    eos_token_id=248044,
    torch_dtype="bfloat16",
)


def _layer_types(layers: int, interval: int = 4) -> list[str]:
    """Every ``interval``-th layer full attention, the rest Gated DeltaNet."""
    kinds = ("linear_attention", "full_attention")
    return [kinds[(i + 1) % interval == 0] for i in range(layers)]


HYBRID_SHAPES = {
    # Qwen/Qwen3.5-9B's text_config: hidden 4096, 16/4 heads of 256, intermediate 12288 as
    # published; 32 layers as transformers' Qwen3_5TextConfig defaults ("Qwen3.5-9B style")
    "qwen3.5-9b": dict(
        QWEN3_5_COMMON,
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        layer_types=_layer_types(32),
        num_attention_heads=16,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    # Qwen/Qwen3.5-35B-A3B's text_config (the same dimensions in transformers' Qwen3.5-MoE
    # defaults and in published training recipes for this size)
    "qwen3.5-35b-a3b": dict(
        QWEN3_5_COMMON,
        architectures=["Qwen3_5MoeForCausalLM"],
        model_type="qwen3_5_moe_text",
        hidden_size=2048,
        num_hidden_layers=40,
        layer_types=_layer_types(40),
        num_attention_heads=16,
        num_key_value_heads=2,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
    ),
}
