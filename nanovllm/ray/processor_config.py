import os
from dataclasses import dataclass, field

from nanovllm.config import Config

ENGINE_KWARGS = tuple(name for name in Config.field_names() if name != "model")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_count(name: str, value, low: int = 1) -> None:
    if not _is_int(value):
        raise TypeError(
            f"ProcessorConfig.{name} must be an int, got {value!r} ({type(value).__name__})"
        )
    if value < low:
        raise ValueError(f"ProcessorConfig.{name} must be >= {low}, got {value}")


@dataclass(frozen=True)
class ProcessorConfig:
    """How ``build_llm_processor`` runs the engines (docs/parallel.md); checked when made."""

    model_source: str  # the model folder, at this path on every node
    engine_kwargs: dict = field(default_factory=dict)  # LLM() keywords, the same for every engine
    concurrency: int | tuple[int, int] = 1  # engines in the pool, or (min, max) to autoscale
    batch_size: int = 64  # rows per generate call
    num_gpus: float | None = None  # per engine; None: tensor_parallel_size if the cluster has GPUs

    def __post_init__(self) -> None:
        self._accept_vllm_kwargs()
        source = self.model_source
        if not isinstance(source, (str, os.PathLike)) or not os.fspath(source):
            kind = ValueError if isinstance(source, (str, os.PathLike)) else TypeError
            raise kind(
                f"ProcessorConfig.model_source must be the path of a model folder, got {source!r}"
            )
        object.__setattr__(self, "model_source", os.fspath(source))
        self._check_engine_kwargs()
        concurrency = self.concurrency
        if isinstance(concurrency, tuple):
            if len(concurrency) != 2 or not all(_is_int(c) for c in concurrency):
                raise TypeError(
                    f"ProcessorConfig.concurrency must be an int or a (min, max) tuple of ints, "
                    f"got {concurrency!r}"
                )
            if not 1 <= concurrency[0] <= concurrency[1]:
                raise ValueError(
                    f"ProcessorConfig.concurrency as (min, max) must have 1 <= min <= max, "
                    f"got {concurrency!r}"
                )
        elif not _is_int(concurrency):
            raise TypeError(
                f"ProcessorConfig.concurrency must be an int or a (min, max) tuple of ints, "
                f"got {concurrency!r} ({type(concurrency).__name__})"
            )
        else:
            _check_count("concurrency", concurrency)
        _check_count("batch_size", self.batch_size)
        self._check_num_gpus()

    def _accept_vllm_kwargs(self) -> None:
        kwargs = self.engine_kwargs
        if isinstance(kwargs, dict) and "enable_chunked_prefill" in kwargs:
            if kwargs["enable_chunked_prefill"] is not True:  # always on here
                raise ValueError(
                    "ProcessorConfig.engine_kwargs['enable_chunked_prefill'] must be True "
                    f"(chunked prefill is always on), got {kwargs['enable_chunked_prefill']!r}"
                )
            kwargs = {k: v for k, v in kwargs.items() if k != "enable_chunked_prefill"}
            object.__setattr__(self, "engine_kwargs", kwargs)

    def _check_engine_kwargs(self) -> None:
        kwargs = self.engine_kwargs
        if not isinstance(kwargs, dict):
            raise TypeError(
                f"ProcessorConfig.engine_kwargs must be a dict of LLM() keywords, "
                f"got {type(kwargs).__name__}"
            )
        for key in kwargs:
            if key == "model":
                raise TypeError(
                    "ProcessorConfig.engine_kwargs must not hold 'model': "
                    "model_source names the model"
                )
            if key not in ENGINE_KWARGS:
                raise TypeError(
                    f"ProcessorConfig.engine_kwargs holds {key!r}, which LLM() does not accept; "
                    f"accepted: {', '.join(ENGINE_KWARGS)}"
                )
        tp = kwargs.get("tensor_parallel_size", 1)
        if not _is_int(tp) or tp < 1:
            kind = ValueError if _is_int(tp) else TypeError
            raise kind(
                "ProcessorConfig.engine_kwargs['tensor_parallel_size'] must be an int >= 1, "
                f"got {tp!r}"
            )
        # its own copy: the caller's later changes stay out
        object.__setattr__(self, "engine_kwargs", dict(kwargs))

    def _check_num_gpus(self) -> None:
        gpus = self.num_gpus
        if gpus is None:
            return
        if isinstance(gpus, bool) or not isinstance(gpus, (int, float)):
            raise TypeError(
                "ProcessorConfig.num_gpus must be a number or None, "
                f"got {gpus!r} ({type(gpus).__name__})"
            )
        if not 0 <= gpus < float("inf"):
            raise ValueError(
                f"ProcessorConfig.num_gpus must be a finite number >= 0 or None, got {gpus!r}"
            )
        tp = self.tensor_parallel_size
        # one engine may share a GPU (a fraction); tensor-parallel ranks need one each
        if tp > 1 and 0 < gpus < tp:
            raise ValueError(
                f"ProcessorConfig.num_gpus must be 0 (engines on the CPU) or at least "
                f"tensor_parallel_size={tp}, got {gpus}"
            )

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine_kwargs.get("tensor_parallel_size", 1)

    def resolved_num_gpus(self, cluster_gpus: float) -> float:
        if self.num_gpus is not None:
            return self.num_gpus
        return self.tensor_parallel_size if cluster_gpus > 0 else 0


ONLY_DEFAULT = {  # ray.data.llm's fields that change nothing here at these values
    "apply_chat_template": True,  # rows with messages are rendered with the model's template
    "tokenize": True,
    "detokenize": True,
    "has_image": False,
    "task_type": "generate",
    "accelerator_type": None,
    "runtime_env": None,
    "max_pending_requests": None,
    "max_concurrent_batches": None,
    "chat_template": None,
}


@dataclass(frozen=True)
class vLLMEngineProcessorConfig(ProcessorConfig):
    """``ray.data.llm``'s config by its name; its other fields only at the values that change
    nothing here."""

    apply_chat_template: bool = True
    tokenize: bool = True
    detokenize: bool = True
    has_image: bool = False
    task_type: str = "generate"
    accelerator_type: str | None = None
    runtime_env: dict | None = None
    max_pending_requests: int | None = None
    max_concurrent_batches: int | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        for name, default in ONLY_DEFAULT.items():
            if (value := getattr(self, name)) != default:
                raise ValueError(
                    f"vLLMEngineProcessorConfig.{name} must be {default!r} here, got {value!r}"
                )
        super().__post_init__()
