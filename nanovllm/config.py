"""Engine configuration: what the user set, checked once, and what is derived from it."""

import os
from dataclasses import dataclass, field, fields

CHOICES = {
    "device": ("auto", "cuda", "cpu"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "attention_backend": ("auto", "flash-attn", "triton", "torch"),
    "kv_cache_dtype": ("auto", "fp8", "fp8_e4m3"),  # "fp8": e4m3 with per-row scales
    "load_format": ("auto", "dummy"),  # "dummy": random weights, no weight files read
    "data_parallel_backend": ("mp", "ray"),  # processes of this host, or Ray actors
}
INTS = {  # name: (lowest, highest)
    "max_num_batched_tokens": (1, None),
    "max_num_seqs": (1, 65535),  # a decode's rows are a CUDA grid's second dimension
    "max_model_len": (2, None),
    "tensor_parallel_size": (1, 8),
    "data_parallel_size": (1, None),
    "kvcache_block_size": (1, None),
    "num_kvcache_blocks": (-1, None),
    "max_logprobs": (-1, None),  # -1: no limit
    "seed": (0, 2**32 - 1),  # None too (NumPy's generator takes 32 bits)
}
BOOLS = ("enforce_eager", "async_scheduling", "enable_sleep_mode", "disable_custom_all_reduce")
BOOLS += ("enable_prefix_caching",)
# config.json keys every supported model reads, and those only some architectures read
MODEL_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
MODEL_CONFIG_KEYS += ("vocab_size",)
MOE_CONFIG_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
ARCHITECTURE_CONFIG_KEYS = {"Qwen3MoeForCausalLM": MOE_CONFIG_KEYS}
UNREAD_KEYS = {"qwen3_5_moe_text": ("intermediate_size",)}  # model_type: no dense MLP


@dataclass
class Config:
    """Every keyword of ``LLM(model, **kwargs)``."""

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1  # -1: sized from free memory
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    async_scheduling: bool = True
    quantization: str | None = None  # "fp8": quantize a float checkpoint's linear layers at load
    enable_sleep_mode: bool = False  # allow llm.sleep(level) / llm.wake_up()
    disable_custom_all_reduce: bool = False  # True: NCCL sums every all-reduce
    seed: int | None = 0  # of unseeded requests' sampling (None: a new draw each run)
    enable_prefix_caching: bool = True
    tokenizer: str | None = None  # a folder with the tokenizer files (None: the model's)
    max_logprobs: int = 20  # the most ``logprobs`` / ``prompt_logprobs`` a request may ask for
    profiler_config: dict | None = None  # {"profiler": "torch", "torch_profiler_dir": path}
    lora_config: object = None  # adapters (lora/config.py: LoRAConfig, from enable_lora=True)
    hf_config: object = field(default=None, init=False, repr=False)
    seed_offset: int = field(default=0, init=False)  # r: replica r of a seeded engine (seed + r)
    # an FP8 checkpoint's "fp8" whatever ``quantization`` says, else ``quantization``
    weight_quantization: str | None = field(default=None, init=False)
    resolved_attention_backend: str = field(default="", init=False)  # "torch", "triton", ...

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            msg = "a path to a local model folder"
            raise TypeError(f"Config.model must be {msg}, got {self.model!r}")
        self.model = os.fspath(self.model)
        config_file = os.path.join(self.model, "config.json")
        if not os.path.isfile(config_file):
            msg = "a local folder holding config.json and *.safetensors"
            raise ValueError(f"Config.model must be {msg}, got {self.model!r}")
        self._check_fields()
        from transformers import AutoConfig

        check_model_config(config_file)
        try:
            self.hf_config = AutoConfig.from_pretrained(self.model)
        except OSError:
            raise
        except Exception as e:  # transformers' own checks of the other keys
            raise ValueError(f"{config_file}: {e}") from e
        if hasattr(self.hf_config, "text_config"):  # multimodal: the language model alone
            from nanovllm.models.qwen3_5 import language_config

            self.hf_config = language_config(self.hf_config)
        from nanovllm.models.registry import architecture

        architecture(self.hf_config)  # an unsupported model fails here, before any weights load
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        device = self.resolved_device()
        if self.tensor_parallel_size * self.data_parallel_size > 1:
            from nanovllm.parallel.config_checks import check_parallel

            check_parallel(self, device)
        if self.quantization or getattr(self.hf_config, "quantization_config", None) is not None:
            from nanovllm.quantization import resolve_quantization

            self.weight_quantization = resolve_quantization(
                self.quantization, self.hf_config, self.tensor_parallel_size, device
            )
        from nanovllm.layers.attention.selector import resolve_backend_name

        # a backend that cannot run this dtype, KV-cache dtype or block size fails here
        args = (device, self.kvcache_block_size, self.resolved_dtype(device), self.kv_cache_dtype)
        self.resolved_attention_backend = resolve_backend_name(
            self.attention_backend, *args, self.weight_quantization
        )
        if self.num_kvcache_blocks > 0:
            self._check_kv_cache_fits(device)

    def _check_fields(self) -> None:
        for name, (low, high) in INTS.items():
            value = getattr(self, name) if name != "seed" or self.seed is not None else low
            if isinstance(value, bool) or not isinstance(value, int):
                msg = f"{value!r} ({type(value).__name__})"
                raise TypeError(f"Config.{name} must be an int, got {msg}")
            if value < low or (high is not None and value > high):
                allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise ValueError(f"Config.{name} must be {allowed}, got {value}")
        if (bs := self.kvcache_block_size) & (bs - 1):
            raise ValueError(f"Config.kvcache_block_size must be a power of two, got {bs}")
        if self.num_kvcache_blocks == 0:
            msg = "-1 (size from free memory) or >= 1, got 0"
            raise ValueError(f"Config.num_kvcache_blocks must be {msg}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)):
            raise TypeError(f"Config.gpu_memory_utilization must be a number, got {u!r}")
        if not 0 < u <= 1:
            raise ValueError(f"Config.gpu_memory_utilization must be in (0, 1], got {u}")
        for name in BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        for name, choices in CHOICES.items():
            if (value := getattr(self, name)) not in choices:
                allowed = ", ".join(map(repr, choices))
                raise ValueError(f"Config.{name} must be one of {allowed}, got {value!r}")
        if self.lora_config is not None and type(self.lora_config).__name__ != "LoRAConfig":
            raise TypeError(f"Config.lora_config must be a LoRAConfig, got {self.lora_config!r}")
        if self.quantization not in (None, "fp8"):
            msg = f"must be None or 'fp8', got {self.quantization!r}"
            raise ValueError(f"Config.quantization {msg}")

    def _check_kv_cache_fits(self, device: str) -> None:
        import torch

        from nanovllm.models.llama import head_dim
        from nanovllm.runner.kv_cache import block_bytes

        hf, tp = self.hf_config, self.tensor_parallel_size
        kv_heads = max(1, hf.num_key_value_heads // tp)
        need = block_bytes(self, kv_heads, head_dim(hf), self.resolved_dtype(device))
        if device == "cuda":
            memory, where = torch.cuda.get_device_properties(0).total_memory, "each GPU has"
        else:
            need *= tp * self.data_parallel_size  # every replica's ranks share the machine
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            where = "the machine has"
        most, n = memory // need, self.num_kvcache_blocks
        if n > most:
            raise ValueError(
                f"Config.num_kvcache_blocks={n} needs {n * need} bytes of KV cache ({need} bytes "
                f"per block of {self.kvcache_block_size} tokens), but {where} {memory} bytes: at "
                f"most {most} blocks could fit, before weights and activations (-1 sizes the "
                "cache from free memory)"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]

    def resolved_device(self) -> str:
        """The one place that picks the device."""
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            msg = "Config.device is 'cuda' but no CUDA GPU is available; use 'cpu' or 'auto'"
            raise ValueError(msg)
        return self.device

    def resolved_dtype(self, device: str):
        """The checkpoint's on a GPU, float32 on the CPU, unless ``dtype`` says."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if device == "cpu":
            return torch.float32
        hf = self.hf_config
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16


def check_model_config(path: str) -> None:
    """Every size the model reads is an int >= 1; KV heads divide heads, heads hidden_size."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from nanovllm.utils.model_folder import read_json

    raw = (top := read_json(path)).get("text_config") or top  # multimodal: the language model's
    aliases = getattr(CONFIG_MAPPING.get(raw.get("model_type")), "attribute_map", {})
    keys = [k for k in MODEL_CONFIG_KEYS if k not in UNREAD_KEYS.get(raw.get("model_type"), ())]
    for name in raw.get("architectures") or []:
        keys += ARCHITECTURE_CONFIG_KEYS.get(name, ())
    values = {}
    for key in keys + ["num_key_value_heads", "head_dim"]:
        spelled = key if key in raw else aliases.get(key, key)
        if raw.get(spelled) is None:
            if key in keys:
                raise ValueError(f"{path} lacks {key!r}, which the model reads")
            continue
        value = values[key] = raw[spelled]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: {spelled} must be an int >= 1, got {value!r}")
    heads = values["num_attention_heads"]
    kv_heads = values.get("num_key_value_heads", heads)
    if heads % kv_heads:
        msg = f"must be a multiple of num_key_value_heads ({kv_heads})"
        raise ValueError(f"{path}: num_attention_heads ({heads}) {msg}")
    if "head_dim" not in values and (hidden := values["hidden_size"]) % heads:
        msg = f"must be a multiple of num_attention_heads ({heads}) when head_dim is not given"
        raise ValueError(f"{path}: hidden_size ({hidden}) {msg}")
