"""The engine's counters: ``get_stats()`` as a dict."""

IDLE = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0}


def get_stats(llm) -> dict:
    """The core's counters and the last ``generate`` call's throughput; once exited, the
    counters at exit with nothing running."""
    stats = llm.core.stats() if llm._final_stats is None else {**llm._final_stats, **IDLE}
    if llm._final_stats is not None and "replicas" in stats:
        stats["replicas"] = [{**r, **IDLE} for r in stats["replicas"]]
    rates = {f"{kind}_throughput": value for kind, value in llm.last_throughput.items()}
    return {**stats, **rates}
