"""A stream's outputs (``AsyncLLM``, vLLM's ``LLMEngine``): each request's ``RequestOutput``s as
its ``output_kind`` says."""

from dataclasses import dataclass, field, replace

from nanovllm.engine.detokenizer import increments
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import RequestOutputKind


@dataclass
class Live:
    key: str  # the caller's request id
    stream: object  # AsyncLLM: the consumer's collector, ``put(RequestOutput | BaseException)``
    loop: object  # AsyncLLM: the consumer's event loop
    kind: RequestOutputKind
    n: int
    rid: int | None = None  # the engine's id, once queued
    queued: tuple | None = None  # (token_ids, params, text) held while paused with mode "keep"
    sent: list = field(default_factory=list)  # CUMULATIVE: each completion so far
    prompt_logprobs: list | None = None


def request_output(llm, live: Live) -> RequestOutput | None:
    outputs = llm.outputs
    request = outputs.requests[live.rid]
    if live.kind == RequestOutputKind.FINAL_ONLY:
        if not request.finished:
            return None
        return replace(outputs.request_output(live.rid), request_id=live.key)
    new = increments(request)
    if not new:
        return None
    if new[0][0] == 0 and new[0][1]["prompt_logprobs"] is not None:
        live.prompt_logprobs = new[0][1]["prompt_logprobs"]  # Logprob entries
    changed = [_completion(llm, request.completions[i], i, inc) for i, inc in new]
    prompt_logprobs = live.prompt_logprobs
    if live.kind == RequestOutputKind.DELTA:
        prompt_logprobs = live.prompt_logprobs if new[0][1]["prompt_logprobs"] else None
    else:
        if not live.sent:
            live.sent = [CompletionOutput(i, "", [], None, None) for i in range(live.n)]
        for c in changed:
            live.sent[c.index] = accumulate(live.sent[c.index], c)
        changed = [replace(c, token_ids=list(c.token_ids), logprobs=copy(c)) for c in live.sent]
    cached = request.completions[0].num_cached_tokens
    args = (request.prompt, request.prompt_token_ids, prompt_logprobs, changed)
    return RequestOutput(
        live.key, *args, request.finished, cached, lora_request=request.lora_request
    )


def _completion(llm, c, index: int, inc: dict) -> CompletionOutput:
    logprobs = inc["logprobs"]  # Logprob entries (detokenizer.increments ranks them)
    reason = (inc.get("finish_reason"), inc.get("stop_reason"))
    return CompletionOutput(
        index, inc["text"], inc["token_ids"], c.cumulative_logprob, logprobs, *reason
    )


def accumulate(so_far: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    logprobs = None if new.logprobs is None else (so_far.logprobs or []) + new.logprobs
    return replace(
        new, text=so_far.text + new.text, token_ids=so_far.token_ids + new.token_ids,
        logprobs=logprobs,
    )  # fmt: skip


def copy(c: CompletionOutput) -> list | None:
    return None if c.logprobs is None else list(c.logprobs)


def aborted_output(live: Live) -> RequestOutput:
    """A request aborted before it was queued (held by a pause with mode "keep")."""
    token_ids, _, text = live.queued
    completions = [CompletionOutput(i, "", [], None, None, "abort") for i in range(live.n)]
    return RequestOutput(live.key, text, token_ids, None, completions, True)
