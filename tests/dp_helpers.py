"""Helpers of the data-parallel tests (processes of this host, and Ray actors): a workload with
chunked prefill, n > 1 and shared prefixes, outputs reduced to what must be equal, and the check
that every replica is idle."""

from hf_reference import mixed_prompts

from nanovllm import LLM, SamplingParams


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = mixed_prompts()
    params = [
        SamplingParams(temperature=0, max_tokens=6 + i % 5, n=2 if i % 4 == 1 else 1)
        for i in range(len(prompts))
    ]
    return prompts, params


def seeded_params(count: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.9, seed=11 + i, n=3 if i == 2 else 1, max_tokens=12)
        for i in range(count)
    ]


def summary(outputs: list[dict]) -> list:
    """Per prompt: its ids, and each completion's token ids, text and finish reason."""
    return [
        (
            o["prompt_token_ids"],
            [(c["token_ids"], c["text"], c["finish_reason"]) for c in o["outputs"]],
        )
        for o in outputs
    ]


def streamed(llm: LLM, prompts, params) -> list:
    """``stream``'s increments concatenated per completion, in ``summary``'s form."""
    got: dict[tuple[int, int], list] = {}
    for inc in llm.stream(prompts, params):
        entry = got.setdefault((inc["index"], inc["completion"]), [[], "", None])
        entry[0] += inc["token_ids"]
        entry[1] += inc["text"]
        if inc["finished"]:
            entry[2] = inc["finish_reason"]
    return [
        (p, [tuple(got[i, c]) for c in range(sp.n)])
        for i, (p, sp) in enumerate(zip(prompts, params))
    ]


def assert_idle(llm: LLM) -> None:
    """Nothing running or waiting and no block held, in the sums and in every replica."""
    stats = llm.get_stats()
    for s in [stats] + stats.get("replicas", []):
        assert (s["num_requests_running"], s["num_requests_waiting"], s["kv_cache_usage"]) == (
            0,
            0,
            0.0,
        ), stats
    assert llm.is_finished()
