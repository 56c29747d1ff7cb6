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


def reset_prefix_cache(llm, reset_running_requests: bool = False) -> bool:
    """Forget every cached prefix block (those in use stay until their sequences end);
    ``reset_running_requests``: preempt every sequence first, so that no block survives."""
    llm._check_running(asleep_ok=True)
    llm._process(llm.core.settle())  # with replicas: no call in flight
    if reset_running_requests:
        preempt = getattr(llm.core, "preempt_all", None)  # the replicas'
        preempt() if preempt is not None else preempt_all(llm.core)
    return llm.core.reset_prefix_cache()


def preempt_all(core) -> None:
    """Free every block of an ``EngineCore``: its sequences wait, to be computed again."""
    if core._launched is not None:  # the next step takes its tokens before it schedules
        core._launched.needs_sync = True
    s = core.scheduler
    for seq in s.waiting:
        if seq.block_table:  # a chunked prefill in progress starts again
            s.block_manager.deallocate(seq)
    while s.running:
        s.preempt(s.running.pop())
