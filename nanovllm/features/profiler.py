"""``LLM.start_profile`` / ``stop_profile``: a torch profiler trace per rank (docs/features.md)."""

import logging
import os
import re
from dataclasses import asdict, is_dataclass

logger = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "CUDA")
TORCH_FLAGS = {  # implemented: name -> default
    "torch_profiler_with_stack": True,
    "torch_profiler_with_flops": False,
    "torch_profiler_use_gzip": True,
    "torch_profiler_dump_cuda_time_total": True,
    "torch_profiler_record_shapes": False,
    "torch_profiler_with_memory": False,
}
ONLY_DEFAULT = {  # vLLM's options accepted only at their default, which is what happens here
    "proton_profiler_dir": "",
    "proton_context": "shadow",
    "proton_data": "tree",
    "proton_backend": None,
    "proton_mode": None,
    "proton_hook": None,
    "proton_output_format": None,
    "proton_graph_attribution": False,
    "capture_torch_profiler": False,
    "detailed_trace_annotation": False,
    "ignore_frontend": False,  # rank 0's trace holds the front end: it runs in that process
    "delay_iterations": 0,
    "max_iterations": 0,
    "warmup_iterations": 0,
    "active_iterations": 5,  # used by a schedule, which needs warmup_iterations > 0
    "wait_iterations": 0,
}
KEYS = ("profiler", "torch_profiler_dir", "torch_profiler_activities", *TORCH_FLAGS)
KEYS += tuple(ONLY_DEFAULT)
ENABLE = (
    "profiling is not enabled: create the LLM with "
    "profiler_config={'profiler': 'torch', 'torch_profiler_dir': '<a directory for traces>'}"
)
PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _fail(key: str, value, allowed: str):
    raise ValueError(f"profiler_config[{key!r}] must be {allowed}, got {value!r}")


def check_config(config) -> dict | None:
    """``profiler_config`` (a dict, or an object with vLLM's ProfilerConfig fields) checked:
    the full settings, or None when no profiler is chosen."""
    if is_dataclass(config) and not isinstance(config, type):
        config = asdict(config)
    elif not isinstance(config, dict) and hasattr(config, "profiler"):
        config = {k: getattr(config, k) for k in KEYS if hasattr(config, k)}
    if not isinstance(config, dict):
        raise TypeError(
            f"profiler_config must be a dict or a ProfilerConfig, got {type(config).__name__}"
        )
    if unknown := [k for k in config if k not in KEYS]:
        raise ValueError(
            f"profiler_config has unknown key {unknown[0]!r}; known: {', '.join(KEYS)}"
        )
    for key, default in ONLY_DEFAULT.items():
        if key in config and config[key] != default:
            _fail(key, config[key], f"{default!r} (the only value supported here)")
    kind, where = config.get("profiler"), config.get("torch_profiler_dir", "")
    if kind is None:
        if where or config.get("torch_profiler_activities") is not None:
            _fail("profiler", kind, "'torch' when torch_profiler_dir or activities are set")
        return None
    if kind != "torch":
        _fail("profiler", kind, "'torch' or None ('cuda' and 'proton' are not supported here)")
    if not isinstance(where, (str, os.PathLike)) or not os.fspath(where) or "://" in str(where):
        _fail("torch_profiler_dir", where, "a local directory path when profiler is 'torch'")
    activities = config.get("torch_profiler_activities")
    if activities is not None and (
        not isinstance(activities, (list, tuple))
        or not activities
        or len(set(activities)) != len(activities)
        or any(a not in ACTIVITIES for a in activities)
    ):
        _fail("torch_profiler_activities", activities, "None or a list of 'CPU', 'CUDA' once each")
    out = {"profiler": "torch", "torch_profiler_activities": activities}
    out["torch_profiler_dir"] = os.path.abspath(os.path.expanduser(os.fspath(where)))
    for key, default in TORCH_FLAGS.items():
        value = out[key] = config.get(key, default)
        if not isinstance(value, bool):
            _fail(key, value, "a bool")
    return out


# ---- every rank ------------------------------------------------------------------------------


def start_rank(runner, settings: dict, name: str) -> None:
    import torch

    if getattr(runner, "torch_profiler", None) is not None:
        logger.warning("start_profile: the profiler is already running; ignored")
        return
    default = ["CPU", "CUDA"] if runner.device.type == "cuda" else ["CPU"]
    activities = settings["torch_profiler_activities"] or default
    if "CUDA" in activities and runner.device.type != "cuda":
        _fail("torch_profiler_activities", activities, "['CPU'] on the CPU")
    kinds = torch.profiler.ProfilerActivity
    profiler = torch.profiler.profile(
        activities=[getattr(kinds, a) for a in activities],
        with_stack=settings["torch_profiler_with_stack"],
        with_flops=settings["torch_profiler_with_flops"],
        record_shapes=settings["torch_profiler_record_shapes"],
        profile_memory=settings["torch_profiler_with_memory"],
    )
    runner.sync()
    profiler.start()
    runner.torch_profiler = (profiler, settings, activities, name)


def stop_rank(runner) -> str | None:
    """Write this rank's trace (and key averages) into the directory; the trace's path."""
    state = getattr(runner, "torch_profiler", None)
    if state is None:
        logger.warning("stop_profile: the profiler is not running; nothing to stop")
        return None
    runner.torch_profiler = None
    profiler, settings, activities, name = state
    runner.sync()
    profiler.stop()
    where = settings["torch_profiler_dir"]
    os.makedirs(where, exist_ok=True)
    worker = f"{name}_tp{runner.rank}"
    if runner.config.data_parallel_size > 1:  # replicas' ranks share names: the process tells
        worker = f"{name}_pid{os.getpid()}_tp{runner.rank}"
    path = os.path.join(where, f"{worker}.pt.trace.json")
    path += ".gz" if settings["torch_profiler_use_gzip"] else ""
    profiler.export_chrome_trace(path)
    key = None
    if activities != ["CPU"] and settings["torch_profiler_dump_cuda_time_total"]:
        key = "self_device_time_total"
    elif activities == ["CPU"]:
        key = "self_cpu_time_total"
    if key is not None:
        try:
            table = profiler.key_averages().table(sort_by=key, row_limit=50)
        except UnicodeDecodeError as e:  # torch's parser meets a garbled event name at times
            logger.warning("stop_profile: %s's key averages not written (%s)", worker, e)
            return path
        with open(os.path.join(where, f"{worker}.profiler_out.txt"), "w") as f:
            print(table, file=f)
    return path


# ---- LLM methods ---------------------------------------------------------------------------


def start_profile(
    llm, profile_prefix=None, *, delay_iterations=None, max_iterations=None, profiler_kwargs=None
) -> None:
    """Start a torch profiler on every rank; ``stop_profile`` writes one trace per rank."""
    llm._check_running(asleep_ok=True)
    settings = check_config(llm.config.profiler_config or {})
    if settings is None:
        raise RuntimeError(ENABLE)
    if profile_prefix is not None and (
        not isinstance(profile_prefix, str) or not PREFIX.fullmatch(profile_prefix)
    ):
        raise ValueError(
            "profile_prefix must be 1-128 ASCII letters, digits, '.', '_' or '-', starting with "
            f"a letter or digit, got {profile_prefix!r}"
        )
    for key, value in (("delay_iterations", delay_iterations), ("max_iterations", max_iterations)):
        if value not in (None, 0):
            raise ValueError(f"start_profile: {key} must be None or 0 here, got {value!r}")
    if profiler_kwargs:
        raise ValueError(f"start_profile: profiler_kwargs must be None here, got {profiler_kwargs}")
    llm._process(llm.core.settle())  # nothing of an earlier call in flight
    llm.core.collective_rpc(start_rank, (settings, profile_prefix or "trace"))


def stop_profile(llm) -> None:
    llm._check_running(asleep_ok=True)
    if check_config(llm.config.profiler_config or {}) is None:
        raise RuntimeError(ENABLE)
    llm._process(llm.core.settle())
    llm.core.collective_rpc(stop_rank)
