"""The original step loop: ``add_request(prompt, params)``, then ``step()`` until
``is_finished()``; each finished completion comes back once, as ``(seq_id, token_ids)``."""

from nanovllm.sampling_params import SamplingParams


def add_request(llm, prompt, sampling_params: SamplingParams, lora_request=None) -> int:
    """Queue one request; returns its id (``step`` reports completion ``i`` as id + i)."""
    llm._check_running()
    return llm._queue(
        *checked(llm, llm.inputs.check(prompt, sampling_params, "prompt"), lora_request)
    )


def checked(llm, request: tuple, lora_request) -> tuple:
    """A checked request with its adapter (``lora_request``: a LoRARequest or None)."""
    if lora_request is None:
        return request
    from nanovllm.lora.api import with_adapters

    return with_adapters(llm, [request], lora_request)[0]


def abort_request(llm, request_id: int) -> bool:
    """False when no such request is queued."""
    if llm._exited or not llm.core.abort_request(request_id):
        return False
    llm.outputs.abort(request_id)
    if request_id not in llm._owned:
        llm.outputs.pop(request_id)
    return True


def step(llm) -> tuple[list[tuple[int, list[int]]], int]:
    """``add_request``'s finished ``(seq_id, token_ids)``, and the prefill tokens (> 0) or minus
    the decoded sequences (< 0)."""
    _, num_tokens = llm._step()
    outputs, llm._unclaimed = llm._unclaimed, []
    return outputs, num_tokens
