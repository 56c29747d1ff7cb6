"""Engine configuration: what the user set, checked once; derived values live on the engine."""

import os
from dataclasses import dataclass, field, fields

DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "flash-attn", "triton", "torch")
LOAD_FORMATS = ("auto", "dummy")  # "dummy": no weight files; random weights drawn on the device
DATA_PARALLEL_BACKENDS = (
    "mp",
    "ray",
)  # replicas in processes of this host, or in Ray actors of a cluster
QUANTIZATIONS = (None, "fp8")  # weights: None (as the checkpoint is), "fp8" (128x128 blocks, W8A8)
KV_CACHE_DTYPES = (
    "auto",
    "fp8",
    "fp8_e4m3",
)  # "auto": the model's dtype; "fp8" (= "fp8_e4m3"): e4m3 with per-row scales
# config.json keys every supported model reads (transformers would fill in its own defaults, which
# then disagree with the weights), and those only some architectures read
MODEL_CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
)
ARCHITECTURE_CONFIG_KEYS = {
    "Qwen3MoeForCausalLM": ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
}


def _check_int(name: str, value, low: int, high: int | None = None, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Config.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"Config.{name} must be {allowed}{extra}, got {value}")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(
            f"Config.{name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )


@dataclass
class Config:
    """Every keyword of ``LLM(model, **kwargs)``; an unknown keyword is a TypeError."""

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
    num_kvcache_blocks: int = -1
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    async_scheduling: bool = True
    quantization: str | None = (
        None  # "fp8": quantize a float checkpoint's linear layers at load (FP8 checkpoints need not ask)
    )
    enable_sleep_mode: bool = False  # allow llm.sleep(level) / llm.wake_up() (features/sleep.py)
    # False: tensor parallelism's CUDA graphs sum tensors up to 8 MiB with the one-shot kernel
    # (utils/custom_all_reduce.py); True: NCCL sums every all-reduce
    disable_custom_all_reduce: bool = False
    hf_config: object = field(default=None, init=False, repr=False)
    # what the weights run as: an FP8 checkpoint's "fp8" whatever ``quantization`` says, else ``quantization``
    weight_quantization: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(
                f"Config.model must be a path to a local model folder, got {self.model!r}"
            )
        self.model = os.fspath(self.model)
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(
                f"Config.model must be a local folder holding config.json and *.safetensors, got {self.model!r}"
            )
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 8)
        _check_int("data_parallel_size", self.data_parallel_size, 1)
        _check_choice("data_parallel_backend", self.data_parallel_backend, DATA_PARALLEL_BACKENDS)
        _check_int("kvcache_block_size", self.kvcache_block_size, 1)
        if self.kvcache_block_size & (self.kvcache_block_size - 1):
            raise ValueError(
                f"Config.kvcache_block_size must be a power of two, got {self.kvcache_block_size}"
            )
        _check_int("num_kvcache_blocks", self.num_kvcache_blocks, -1)
        if self.num_kvcache_blocks == 0:
            raise ValueError(
                "Config.num_kvcache_blocks must be -1 (size from free memory) or >= 1, got 0"
            )
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)):
            raise TypeError(f"Config.gpu_memory_utilization must be a number, got {u!r}")
        if not 0 < u <= 1:
            raise ValueError(f"Config.gpu_memory_utilization must be in (0, 1], got {u}")
        if not isinstance(self.enforce_eager, bool):
            raise TypeError(f"Config.enforce_eager must be a bool, got {self.enforce_eager!r}")
        if not isinstance(self.async_scheduling, bool):
            raise TypeError(
                f"Config.async_scheduling must be a bool, got {self.async_scheduling!r}"
            )
        for name in ("enable_sleep_mode", "disable_custom_all_reduce"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        _check_choice("device", self.device, DEVICES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"Config.quantization must be None or 'fp8', got {self.quantization!r}"
            )

        from transformers import AutoConfig

        config_file = os.path.join(self.model, "config.json")
        check_model_config(config_file)
        try:
            self.hf_config = AutoConfig.from_pretrained(self.model)
        except OSError:
            raise
        except Exception as e:  # transformers' own checks of the other keys
            raise ValueError(f"{config_file}: {e}") from e
        from nanovllm.models.registry import architecture

        architecture(self.hf_config)  # an unsupported model fails here, before any weights load
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        # a backend that cannot run this dtype / KV-cache dtype / block size fails now, before any
        # process starts or weights load (the model runner asks the same function again, adding the
        # weights' quantization, which only steers "auto")
        from nanovllm.layers.attention import resolve_backend_name

        device = self.resolved_device()
        resolve_backend_name(
            self.attention_backend,
            device,
            self.kvcache_block_size,
            self.resolved_dtype(device),
            self.kv_cache_dtype,
        )
        self._check_parallel(device)
        from nanovllm.quantization import resolve_quantization

        self.weight_quantization = resolve_quantization(
            self.quantization, self.hf_config, self.tensor_parallel_size, device
        )
        if self.num_kvcache_blocks > 0:
            self._check_kv_cache_fits(device)

    def _check_parallel(self, device: str) -> None:
        """The model must split over ``tensor_parallel_size`` ranks, and the replicas of this host
        (``data_parallel_backend="mp"``) need ``data_parallel_size × tensor_parallel_size`` GPUs."""
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        for name in (
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "intermediate_size",
        ):
            value = getattr(self.hf_config, name)
            if value % tp:
                raise ValueError(
                    f"Config.tensor_parallel_size={tp} must divide the model's {name} ({value})"
                )
        if device == "cuda" and self.data_parallel_backend == "mp":
            import torch

            visible = torch.cuda.device_count()
            if tp * dp > visible:
                need = (
                    f"tensor_parallel_size={tp}"
                    if dp == 1
                    else f"data_parallel_size={dp} × tensor_parallel_size={tp}"
                )
                raise ValueError(
                    f"Config.{need} needs {tp * dp} GPUs, but only {visible} GPU(s) are visible"
                )

    def _check_kv_cache_fits(self, device: str) -> None:
        """A fixed ``num_kvcache_blocks`` must fit in the memory of one GPU (each rank's share of
        the KV heads), or on the CPU in the machine's memory (every rank's share together), before
        any weights load. The cache alone is counted, so this is the most that could ever fit."""
        import torch

        from nanovllm.models.llama import head_dim
        from nanovllm.runner.kv_cache import block_bytes

        hf, tp = self.hf_config, self.tensor_parallel_size
        per_rank = block_bytes(
            self, max(1, hf.num_key_value_heads // tp), head_dim(hf), self.resolved_dtype(device)
        )
        if device == "cuda":
            memory, need, where = (
                torch.cuda.get_device_properties(0).total_memory,
                per_rank,
                "each GPU has",
            )
        else:
            need = (
                per_rank * tp * self.data_parallel_size
            )  # every replica's ranks share the machine
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            where = "the machine has"
        most = memory // need
        if self.num_kvcache_blocks > most:
            raise ValueError(
                f"Config.num_kvcache_blocks={self.num_kvcache_blocks} needs {self.num_kvcache_blocks * need} bytes "
                f"of KV cache ({need} bytes per block of {self.kvcache_block_size} tokens), but {where} {memory} "
                f"bytes: at most {most} blocks could fit, before weights and activations (-1 sizes the cache "
                "from free memory)"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]

    def resolved_device(self) -> str:
        """The one place that picks the device: "cuda" when asked for or available, else "cpu"."""
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "Config.device is 'cuda' but no CUDA GPU is available; use 'cpu' or 'auto'"
            )
        return self.device

    def resolved_dtype(self, device: str):
        """The run dtype: the checkpoint's on GPU, float32 on CPU, unless ``dtype`` forces one."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if device == "cpu":
            return torch.float32
        dtype = getattr(self.hf_config, "dtype", None) or getattr(
            self.hf_config, "torch_dtype", None
        )
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16


def check_model_config(path: str) -> None:
    """``config.json`` must give every size the model reads, as a positive int, and sizes that fit
    together (heads a multiple of KV heads; without ``head_dim``, hidden_size a multiple of heads).
    A missing key or a bad value is a ValueError naming the file, the key and the value. A key may
    be spelled as its transformers alias (Qwen3-MoE's ``num_local_experts`` for ``num_experts``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from nanovllm.utils.model_folder import read_json

    raw = read_json(path)
    config_class = CONFIG_MAPPING.get(raw.get("model_type"))  # an unknown type fails in AutoConfig
    aliases = getattr(config_class, "attribute_map", {})
    keys = list(MODEL_CONFIG_KEYS)
    for name in raw.get("architectures") or []:
        keys += ARCHITECTURE_CONFIG_KEYS.get(name, ())
    values = {}
    for key in keys + ["num_key_value_heads", "head_dim"]:
        spelled = key if key in raw else aliases.get(key, key)
        if spelled not in raw or raw[spelled] is None:
            if key in keys:
                raise ValueError(f"{path} lacks {key!r}, which the model reads")
            continue
        value = values[key] = raw[spelled]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: {spelled} must be an int >= 1, got {value!r}")
    heads, kv_heads = (
        values["num_attention_heads"],
        values.get("num_key_value_heads", values["num_attention_heads"]),
    )
    if heads % kv_heads:
        raise ValueError(
            f"{path}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    if "head_dim" not in values and values["hidden_size"] % heads:
        raise ValueError(
            f"{path}: hidden_size ({values['hidden_size']}) must be a multiple of num_attention_heads ({heads}) "
            "when head_dim is not given"
        )
