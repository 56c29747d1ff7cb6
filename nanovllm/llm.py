from importlib import import_module

from nanovllm.engine.llm_engine import LLMEngine


class feature:
    """A method that lives in ``module`` (``"nanovllm.<module>"``), imported on first use."""

    def __init__(self, module: str, on_class: bool = False):
        self.module, self.on_class = f"nanovllm.{module}", on_class

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        fn = getattr(import_module(self.module), self.name)
        bound_to = owner if self.on_class else obj
        return fn if bound_to is None else fn.__get__(bound_to, owner)


class LLM(LLMEngine):
    """The public entry point: ``LLM(model_dir, **config).generate(prompts, sampling_params)``.
    The methods below are features, each in its own module."""

    add_request = feature("entrypoints.step_loop")
    step = feature("entrypoints.step_loop")
    abort_request = feature("entrypoints.step_loop")
    get_stats = feature("entrypoints.metrics")
    chat = feature("engine.chat")
    stream = feature("entrypoints.stream")
    sleep = feature("features.sleep")
    wake_up = feature("features.sleep")
    is_sleeping = feature("features.sleep")
    update_weights = feature("features.weight_update")
    reset_prefix_cache = feature("features.idle")
    check_idle = feature("features.idle")
    from_engine_args = feature("engine.arg_utils", on_class=True)
    start_profile = feature("features.profiler")
    stop_profile = feature("features.profiler")
    get_metrics = feature("entrypoints.metrics")
    get_tokenizer = feature("entrypoints.tokenizer")
    collective_rpc = feature("features.rpc")
    add_lora = feature("lora.api")
    remove_lora = feature("lora.api")
    list_loras = feature("lora.api")
    pin_lora = feature("lora.api")
