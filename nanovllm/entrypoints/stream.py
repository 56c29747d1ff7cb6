"""``LLM.stream``: each request's new tokens and text as steps produce them."""

from collections.abc import Iterator
from contextlib import closing

from nanovllm.engine.detokenizer import increments


def stream(llm, prompts, sampling_params=None, lora_request=None) -> Iterator[dict]:
    llm._check_running()
    requests = llm.inputs.check_all(prompts, sampling_params, llm.get_default_sampling_params)
    if lora_request is not None:
        from nanovllm.lora.api import with_adapters

        requests = with_adapters(llm, requests, lora_request)
    return _increments(llm, requests)


def _increments(llm, requests: list) -> Iterator[dict]:
    with closing(llm._run(requests, stream=True)) as steps:
        for request_ids, _ in steps:
            for index, request_id in enumerate(request_ids):
                for completion, inc in increments(llm.outputs.requests[request_id]):
                    yield {"index": index, "completion": completion, **inc}
