"""``LLM.collective_rpc``: a ``ModelRunner`` method or a function on every rank, or one of vLLM's
worker methods by name (``METHODS``: ``update_config``, ``reload_weights``)."""

LOAD_FORMATS = ("auto", "dummy")


def _check_update(llm, overrides) -> tuple:
    if not isinstance(overrides, dict):
        raise TypeError(f"update_config takes a dict of overrides, got {type(overrides).__name__}")
    load = overrides.get("load_config", {})
    unknown = [k for k in overrides if k != "load_config"]
    if not isinstance(load, dict) or unknown or any(k != "load_format" for k in load):
        raise ValueError(
            f"update_config: only {{'load_config': {{'load_format': ...}}}} can change here, "
            f"got {overrides!r}"
        )
    if "load_format" in load and load["load_format"] not in LOAD_FORMATS:
        raise ValueError(
            f"update_config: load_config.load_format must be one of {LOAD_FORMATS}, "
            f"got {load['load_format']!r}"
        )
    return (load.get("load_format"),)


def update_config_rank(runner, load_format: str | None) -> None:
    if load_format is not None:
        runner.config.load_format = load_format


def _check_reload(llm, *args, **kwargs) -> tuple:
    if args or kwargs:
        raise ValueError(
            "reload_weights takes no arguments here (it reads the model folder again, or draws "
            f"dummy weights with load_format='dummy'), got {args!r} {kwargs!r}"
        )
    from nanovllm.features.idle import check_idle
    from nanovllm.features.sleep import weights_awake

    weights_awake(llm)
    if not llm.sleep_level:  # asleep, what sleep(mode="keep") kept holds no KV: it restarts
        check_idle(llm, "reload_weights")
    return ()


def reload_weights_rank(runner) -> None:
    """This rank's weights again: from the model folder (``load_format="auto"``), or drawn."""
    from nanovllm.utils import checkpoint, loader

    runner.sync()
    config = runner.config
    if config.load_format == "dummy":
        checkpoint.init_dummy_weights(runner.model)
    else:
        loader.load_model(runner.model, config.model, config.hf_config)
    runner.sync()


METHODS = {  # vLLM's worker method name: (front-end check -> rank args, the rank's function)
    "update_config": (_check_update, update_config_rank),
    "reload_weights": (_check_reload, reload_weights_rank),
}


def _after(llm, name: str, args: tuple) -> None:
    if name == "reload_weights":  # the prefix cache holds the old weights' keys
        llm.core.reset_prefix_cache()
    elif name == "update_config" and args[0] is not None:  # the front end's copy too
        llm.config.load_format = args[0]


def collective_rpc(llm, method, args: tuple = (), kwargs: dict | None = None, timeout=None):
    """``method`` on every rank of every replica; each replica's rank-0 result."""
    from nanovllm.runner.model_runner import ModelRunner

    if timeout is not None:
        raise ValueError(f"collective_rpc: timeout must be None here (no limit), got {timeout!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"collective_rpc: args must be a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"collective_rpc: kwargs must be a dict or None, got {kwargs!r}")
    if isinstance(method, str) and not callable(getattr(ModelRunner, method, None)):
        if method not in METHODS:
            known = sorted({*METHODS, "a ModelRunner method, or a function of the runner"})
            raise ValueError(f"collective_rpc: unknown method {method!r}; known: {known}")
        llm._check_running(asleep_ok=True)
        check, rank_fn = METHODS[method]
        name, method = method, rank_fn
        args, kwargs = check(llm, *args, **(kwargs or {})), None
        results = llm.core.collective_rpc(method, args, kwargs)
        _after(llm, name, args)
        return results
    llm._check_running(asleep_ok=True)
    return llm.core.collective_rpc(method, tuple(args), kwargs)
