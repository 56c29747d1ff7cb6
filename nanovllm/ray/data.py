"""A Ray Data dataset's rows through an actor pool of engines (docs/parallel.md)."""

import reprlib
from collections.abc import Callable
from dataclasses import fields, replace

try:
    import pyarrow as pa
    import ray
    import ray.data
except ImportError as e:  # the optional extra is missing
    raise ImportError(
        'nanovllm.ray needs Ray Data: pip install -e ".[ray]" (or pip install "ray[data]>=2.40")'
    ) from e

from nanovllm.engine.chat import render
from nanovllm.ray.processor_config import ProcessorConfig
from nanovllm.sampling_params import SamplingParams

CHAT_DEFAULTS = dict(chat_template=None, chat_template_content_format="auto", tools=None)
CHAT_DEFAULTS.update(add_generation_prompt=True, continue_final_message=False)
REQUEST_COLUMNS = ("prompt", "messages", "sampling_params", "chat_template_kwargs")
OUTPUT_TYPES = {
    "generated_text": pa.string(),
    "generated_tokens": pa.list_(pa.int64()),
    "num_input_tokens": pa.int64(),
    "num_generated_tokens": pa.int64(),
    "finish_reason": pa.string(),
}
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))

_short = reprlib.Repr()  # values in error messages
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict = 60, 60, 8, 12


def _plain(value):
    """NumPy arrays and scalars, also nested in lists and dicts, as plain Python values."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # np.ndarray, NumPy scalars
        return _plain(value.tolist())
    return value


def _without_nulls(d: dict) -> dict:
    # Arrow gives every row of a struct column every key any row has (None where it had none)
    return {k: v for k, v in d.items() if v is not None}


def _describe(row: dict) -> str:
    return (
        "{"
        + ", ".join(f"{k!r}: {_short.repr(_plain(v))}" for k, v in _without_nulls(row).items())
        + "}"
    )


class _EngineReplica:
    """One engine of the pool, one ``generate`` per batch; a bad row fails the batch first."""

    def __init__(self, model_source: str, engine_kwargs: dict):
        from nanovllm import LLM

        self.llm = LLM(model_source, **engine_kwargs)
        self.defaults = self.llm.get_default_sampling_params()

    def __call__(self, batch: pa.Table) -> pa.Table:
        present = [name for name in REQUEST_COLUMNS if name in batch.column_names]
        columns = {name: _plain(batch.column(name).to_pylist()) for name in present}
        requests, rendered = [], []
        for i in range(batch.num_rows):
            try:
                requests.append(self.request({name: values[i] for name, values in columns.items()}))
                rendered.append(self.rendered)
            except (TypeError, ValueError) as e:
                kind = TypeError if isinstance(e, TypeError) else ValueError
                raise kind(
                    f"nanovllm.ray: row {_describe(batch.slice(i, 1).to_pylist()[0])}: {e}"
                ) from None
        if not requests:
            return _with_outputs(batch, [])
        outputs = self.llm.generate(
            [r[0] for r in requests], [r[1] for r in requests], use_tqdm=False
        )
        return _with_prompts(_with_outputs(batch, outputs), rendered)

    def request(self, row: dict) -> tuple[list[int], SamplingParams]:
        """One row's prompt token ids and sampling params, checked as ``generate`` checks them
        (``self.rendered``: a conversation's prompt text, for the ``prompt`` column)."""
        self.rendered = None
        prompt, messages = row.get("prompt"), row.get("messages")
        if prompt is None and messages is None:
            raise ValueError(
                "a row needs a 'prompt' (text or token ids) or 'messages' (a conversation); "
                "it has neither"
            )
        if prompt is not None and messages is not None:
            raise ValueError("a row needs one of 'prompt' and 'messages'; it has both")
        sampling_params = self.sampling_params(row.get("sampling_params"))
        if messages is not None:
            token_ids = self.chat_prompt(messages, row.get("chat_template_kwargs"))
            self.rendered = self.llm.tokenizer.decode(token_ids)
            return self.llm.inputs.check(token_ids, sampling_params, "'messages'")
        return self.llm.inputs.check(prompt, sampling_params, "'prompt'")

    def sampling_params(self, value) -> SamplingParams:
        """The model's default params with the row's non-None fields over them."""
        if value is None:
            return self.defaults
        if not isinstance(value, dict):
            raise TypeError(
                f"'sampling_params' must be a dict of SamplingParams fields, "
                f"got {value!r} ({type(value).__name__})"
            )
        given = _without_nulls(value)
        for key in given:
            if key not in SAMPLING_FIELDS:
                raise TypeError(
                    f"'sampling_params' holds {key!r}, which is not a SamplingParams field; "
                    f"fields: {', '.join(SAMPLING_FIELDS)}"
                )
        if given.get("n", 1) != 1:
            raise ValueError(
                f"'sampling_params': n must be 1 (one output row per input row), got {given['n']!r}"
            )
        try:
            return replace(self.defaults, **given)
        except (TypeError, ValueError) as e:
            kind = TypeError if isinstance(e, TypeError) else ValueError
            raise kind(f"'sampling_params': {e}") from None

    def chat_prompt(self, messages, template_kwargs) -> list[int]:
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            raise TypeError(
                "'messages' must be a non-empty list of {'role', 'content'} dicts, "
                f"got {messages!r}"
            )
        conversation = [_without_nulls(m) for m in messages]
        for m in conversation:
            if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise TypeError(
                    f"'messages': a message must have str 'role' and 'content', got {m!r}"
                )
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise TypeError(
                f"'chat_template_kwargs' must be a dict or None, got {template_kwargs!r}"
            )
        options = dict(CHAT_DEFAULTS, chat_template_kwargs=_without_nulls(template_kwargs or {}))
        return render(self.llm.tokenizer, [conversation], options)[0]["prompt_token_ids"]


def _with_outputs(batch: pa.Table, outputs: list[dict]) -> pa.Table:
    # the batch's own columns, then the output columns (replacing any of those names it had)
    values = {
        "generated_text": [o["text"] for o in outputs],
        "generated_tokens": [o["token_ids"] for o in outputs],
        "num_input_tokens": [len(o["prompt_token_ids"]) for o in outputs],
        "num_generated_tokens": [len(o["token_ids"]) for o in outputs],
        "finish_reason": [o["finish_reason"] for o in outputs],
    }
    for name, column in values.items():
        array = pa.array(column, OUTPUT_TYPES[name])
        if name in batch.column_names:
            batch = batch.set_column(batch.column_names.index(name), name, array)
        else:
            batch = batch.append_column(name, array)
    return batch


def _with_prompts(batch: pa.Table, rendered: list[str | None]) -> pa.Table:
    # a conversation's row gets its rendered prompt text in ``prompt`` (a text column, or a new one)
    if "prompt" not in batch.column_names:
        return batch.append_column("prompt", pa.array(rendered, pa.string()))
    i = batch.column_names.index("prompt")
    if not pa.types.is_string(batch.schema.field(i).type) or not any(rendered):
        return batch
    given = batch.column(i).to_pylist()
    column = pa.array([r if r is not None else g for g, r in zip(given, rendered)], pa.string())
    return batch.set_column(i, "prompt", column)


def _actor_pool(concurrency: int | tuple[int, int]) -> "ray.data.ActorPoolStrategy":
    if isinstance(concurrency, tuple):
        return ray.data.ActorPoolStrategy(min_size=concurrency[0], max_size=concurrency[1])
    return ray.data.ActorPoolStrategy(size=concurrency)


def _cluster_gpus() -> float:
    if not ray.is_initialized():
        ray.init()  # as Ray Data does on a dataset's first execution
    return ray.cluster_resources().get("GPU", 0)


def build_llm_processor(
    config: ProcessorConfig,
    preprocess: Callable[[dict], dict] | None = None,
    postprocess: Callable[[dict], dict] | None = None,
) -> Callable[["ray.data.Dataset"], "ray.data.Dataset"]:
    """``Dataset -> Dataset``: ``preprocess`` per row, the engines' pool per batch, then
    ``postprocess`` per row; lazy, the engines start when the dataset is consumed."""
    if not isinstance(config, ProcessorConfig):
        raise TypeError(
            f"config must be a vLLMEngineProcessorConfig (or ProcessorConfig), "
            f"got {type(config).__name__}"
        )
    for name, fn in (("preprocess", preprocess), ("postprocess", postprocess)):
        if fn is not None and not callable(fn):
            raise TypeError(
                f"{name} must be a function from row (dict) to row, or None, got {fn!r}"
            )

    def process(ds: ray.data.Dataset) -> ray.data.Dataset:
        if not isinstance(ds, ray.data.Dataset):
            raise TypeError(f"the processor takes a ray.data.Dataset, got {type(ds).__name__}")
        num_gpus = config.resolved_num_gpus(_cluster_gpus() if config.num_gpus is None else 0)
        if preprocess is not None:
            ds = ds.map(preprocess)
        ds = ds.map_batches(
            _EngineReplica,
            fn_constructor_kwargs={
                "model_source": config.model_source,
                "engine_kwargs": config.engine_kwargs,
            },
            batch_size=config.batch_size,
            batch_format="pyarrow",
            compute=_actor_pool(config.concurrency),
            num_gpus=num_gpus,
        )
        if postprocess is not None:
            ds = ds.map(postprocess)
        return ds

    return process
