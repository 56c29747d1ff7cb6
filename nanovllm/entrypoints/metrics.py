"""The engine's counters: ``get_stats()`` as a dict."""

IDLE = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0}


def get_stats(llm) -> dict:
    """The core's counters, the last ``generate`` call's throughput and whether prefix caching
    is on; once exited, the counters at exit with nothing running."""
    from nanovllm.models.config import kv_layers

    stats = llm.core.stats() if llm._final_stats is None else {**llm._final_stats, **IDLE}
    if llm._final_stats is not None and "replicas" in stats:
        stats["replicas"] = [{**r, **IDLE} for r in stats["replicas"]]
    rates = {f"{kind}_throughput": value for kind, value in llm.last_throughput.items()}
    hf = llm.config.hf_config  # hybrid models (linear-attention layers) have no prefix cache
    caching = llm.config.enable_prefix_caching and kv_layers(hf) == hf.num_hidden_layers
    return {**stats, **rates, "prefix_caching": caching}


COUNTERS = {  # vLLM's counter name: how it follows from one engine's get_stats()
    "vllm:prompt_tokens": lambda s: s["prompt_tokens"] + s["prefix_cache_hits"],
    "vllm:prompt_tokens_cached": lambda s: s["prefix_cache_hits"],
    "vllm:generation_tokens": lambda s: s["generation_tokens"],
    "vllm:prefix_cache_queries": lambda s: s["prefix_cache_queries"],
    "vllm:prefix_cache_hits": lambda s: s["prefix_cache_hits"],
    "vllm:num_preemptions": lambda s: s["num_preemptions"],
}
GAUGES = {
    "vllm:num_requests_running": lambda s: s["num_requests_running"],
    "vllm:num_requests_waiting": lambda s: s["num_requests_waiting"],
    "vllm:kv_cache_usage_perc": lambda s: s["kv_cache_usage"],  # a fraction, as vLLM's
}
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # sleep level 0, 1, 2


def get_metrics(llm) -> list:
    """vLLM's metrics where they mean what ``get_stats()`` counts, one set per engine (label
    ``engine``: the data-parallel replica); this library's own under ``nanovllm:``."""
    from nanovllm.v1.metrics.reader import Counter, Gauge

    stats = get_stats(llm)
    metrics = []
    for i, s in enumerate(stats.get("replicas", [stats])):
        labels = {"model_name": llm.config.model, "engine": str(i)}
        metrics += [Counter(name, dict(labels), int(f(s))) for name, f in COUNTERS.items()]
        metrics += [Gauge(name, dict(labels), float(f(s))) for name, f in GAUGES.items()]
        for level, state in enumerate(SLEEP_STATES):
            value = float(llm.sleep_level == level)
            metrics.append(
                Gauge("vllm:engine_sleep_state", {**labels, "sleep_state": state}, value)
            )
    labels = {"model_name": llm.config.model}
    for kind in ("prefill", "decode"):  # tokens per second in the last generate call
        metrics.append(
            Gauge(f"nanovllm:{kind}_throughput", dict(labels), stats[f"{kind}_throughput"])
        )
    return metrics
