"""vLLM's ``LLM()`` / ``EngineArgs`` options that are not ``Config`` fields: aliases of one,
options that change nothing here, and options accepted only at the value that changes nothing."""

from nanovllm.config import Config

ALIASES = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}
LORA_OPTIONS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
FP8_AND_LORA = "enable_lora=True with FP8 weights is not supported: adapters run on float weights"
# option: (its default, the values accepted; None: any value, since nothing here reads it)
OPTIONS = {
    # logging, metrics and start-up messages
    "disable_log_stats": (False, None),
    "enable_log_requests": (False, None),
    "disable_log_requests": (True, None),
    "aggregate_engine_logging": (False, None),
    "kv_cache_metrics": (False, None),
    "cudagraph_metrics": (False, None),
    "enable_mfu_metrics": (False, None),
    "use_tqdm_on_load": (True, None),
    "served_model_name": (None, None),
    # downloads and remote code: the model is a local folder of a supported architecture
    "trust_remote_code": (False, None),
    "revision": (None, None),
    "code_revision": (None, None),
    "tokenizer_revision": (None, None),
    "download_dir": (None, None),
    "hf_token": (None, None),
    "ignore_patterns": (None, None),
    "safetensors_load_strategy": (None, None),
    "max_parallel_loading_workers": (None, None),
    # speed-only knobs: the outputs are the same at any value
    "compilation_config": (None, None),
    "optimization_level": (None, None),
    "cudagraph_capture_sizes": (None, None),
    "max_cudagraph_capture_size": (None, None),
    "disable_cascade_attn": (None, None),
    "prefix_caching_hash_algo": (None, None),
    "swap_space": (4, None),
    "watermark": (None, None),
    "numa_bind": (False, None),
    "shutdown_timeout": (0, None),
    # multimodal: no model here takes images
    "limit_mm_per_prompt": (None, None),
    "mm_processor_cache_gb": (None, None),
    "skip_mm_profiling": (False, None),
    "language_model_only": (False, None),
    "allowed_local_media_path": ("", None),
    "allowed_media_domains": (None, None),
    # LoRA: these four make Config.lora_config (nanovllm/lora/config.py)
    "enable_lora": (False, None),
    "max_loras": (1, None),
    "max_lora_rank": (16, None),
    "max_cpu_loras": (None, None),
    "disable_sliding_window": (False, None),  # no supported model has a sliding window
    # only the value that changes nothing
    "enable_chunked_prefill": (None, (None, True)),  # chunked prefill is always on
    "tokenizer_mode": ("auto", ("auto", "hf")),
    "config_format": ("auto", ("auto", "hf")),
    "generation_config": ("auto", ("auto",)),  # generation_config.json's defaults are read
    "runner": ("auto", ("auto", "generate")),
    "convert": ("auto", ("auto", "none")),
    "model_impl": ("auto", ("auto",)),
    "skip_tokenizer_init": (False, (False,)),
    "enable_prompt_embeds": (False, (False,)),
    "enable_mm_embeds": (False, (False,)),
    "enable_expert_parallel": (False, (False,)),
    "enable_eplb": (False, (False,)),
    "enable_return_routed_experts": (False, (False,)),
    "return_sampling_mask": (False, (False,)),
    "tokens_only": (False, (False,)),
    "pipeline_parallel_size": (1, (1,)),
    "distributed_executor_backend": (None, (None, "mp")),  # tensor parallelism: processes
    "data_parallel_size_local": (None, (None,)),
    "data_parallel_rank": (None, (None,)),
    "data_parallel_address": (None, (None,)),
    "data_parallel_rpc_port": (None, (None,)),
    "nnodes": (1, (1,)),
    "scheduling_policy": ("fcfs", ("fcfs",)),
    "scheduler_cls": (None, (None,)),
    "stream_interval": (1, (1,)),
    "long_prefill_token_threshold": (0, (0,)),
    "cpu_offload_gb": (0, (0,)),
    "kv_cache_memory_bytes": (None, (None,)),
    "kv_offloading_size": (None, (None,)),
    "calculate_kv_scales": (False, (False,)),
    "quantization_config": (None, (None,)),
    "speculative_config": (None, (None,)),
    "spec_method": (None, (None,)),
    "spec_model": (None, (None,)),
    "spec_tokens": (None, (None,)),
    "kv_transfer_config": (None, (None,)),
    "kv_events_config": (None, (None,)),
    "ec_transfer_config": (None, (None,)),
    "pooler_config": (None, (None,)),
    "hf_overrides": (None, (None, {})),
    "hf_config_path": (None, (None,)),
    "override_generation_config": (None, (None, {})),
    "mm_processor_kwargs": (None, (None, {})),
    "model_loader_extra_config": (None, (None, {})),
    "additional_config": (None, (None, {})),
    "reasoning_parser": ("", ("", None)),
    "worker_cls": ("auto", ("auto",)),
    "worker_extension_cls": ("", ("",)),
    "otlp_traces_endpoint": (None, (None,)),
    "collect_detailed_traces": (None, (None,)),
}


def config_kwargs(kwargs: dict) -> dict:
    """``kwargs`` with vLLM's names mapped to ``Config`` fields and the options that change
    nothing dropped; an unknown name is a TypeError, an unsupported value a ValueError."""
    names = Config.field_names()
    out = {key: value for key, value in kwargs.items() if key in names}
    lora = {key: kwargs[key] for key in LORA_OPTIONS if key in kwargs}
    if lora and out.get("lora_config") is not None:
        raise ValueError(f"LLM() options {', '.join(lora)} and lora_config: give one of them")
    if lora:
        from nanovllm.lora.config import lora_config

        if (config := lora_config(**lora)) is not None:
            if out.get("quantization") is not None:
                raise ValueError(FP8_AND_LORA)
            out["lora_config"] = config
    for key, value in kwargs.items():
        if key in names:
            continue
        if key in ALIASES:
            target = ALIASES[key]
            default = Config.__dataclass_fields__[target].default
            if value is not None and out.get(target, default) not in (default, value):
                msg = f"{key}={value!r} and {target}={out[target]!r} disagree; give one of them"
                raise ValueError(f"LLM() options {msg}")
            if value is not None:
                out[target] = value
        elif key in OPTIONS:
            allowed = OPTIONS[key][1]
            if allowed is not None and not any(_same(value, a) for a in allowed):
                raise ValueError(
                    f"LLM() option {key}={value!r} is not supported; nano-vllm accepts "
                    f"{' or '.join(map(repr, allowed))} (the value that changes nothing here)"
                )
        else:
            accepted = [n for n in names if n != "model"] + sorted([*ALIASES, *OPTIONS])
            msg = f"unexpected keyword argument {key!r}; accepted: {', '.join(accepted)}"
            raise TypeError(f"LLM() got an {msg}")
    return out


def _same(value, allowed) -> bool:
    return value == allowed and isinstance(value, bool) == isinstance(allowed, bool)
