"""What needs the engine idle, or settled: checking it, and resetting the prefix cache."""


def check_idle(llm, what: str) -> None:
    """Raise unless no sequence is queued; ``what`` names the caller in the message."""
    llm._process(llm.core.settle())
    if not llm.core.is_finished():
        s = llm.core.stats()
        raise RuntimeError(
            f"{what} needs an idle engine, but sequences are queued (running "
            f"{s['num_requests_running']}, waiting {s['num_requests_waiting']}): let them "
            "finish (generate, or step() until is_finished()) or abort them first"
        )


def reset_prefix_cache(llm) -> bool:
    """Forget every cached prefix block (those in use stay until their sequences end)."""
    llm._check_running(asleep_ok=True)
    llm._process(llm.core.settle())  # with replicas: no call in flight
    return llm.core.reset_prefix_cache()
