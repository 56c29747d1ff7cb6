"""vLLM's ``LLMEngine``: ``add_request(request_id, prompt, params)``, then ``step()`` until
``has_unfinished_requests()`` is False; each step's ``RequestOutput``s follow the request's
``params.output_kind``."""

from nanovllm.engine.arg_utils import from_engine_args
from nanovllm.engine.detokenizer import increments
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams


class LLMEngine:
    """A step loop over an ``LLM`` (``self.llm``) with the caller's string request ids."""

    from_engine_args = classmethod(from_engine_args)

    def __init__(self, model: str, **kwargs):
        from nanovllm.llm import LLM

        self.llm = LLM(model, **kwargs)
        self.ids: dict[str, int] = {}  # the caller's id of each unfinished request -> internal id

    def add_request(self, request_id: str, prompt, params, arrival_time=None, lora_request=None):
        """Queue one request; ``prompt``: a str, token ids or a prompt dict."""
        llm = self.llm
        llm._check_running()
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.ids:
            raise ValueError(f"request_id {request_id!r} is in use by an unfinished request")
        if lora_request is not None:
            msg = f"must be None (nano-vllm has no LoRA), got {lora_request!r}"
            raise ValueError(f"lora_request {msg}")
        if not isinstance(params, SamplingParams):
            msg = "a SamplingParams (pooling is not supported)"
            raise TypeError(f"params must be {msg}, got {type(params).__name__}")
        token_ids, sp, text = llm.inputs.check(prompt, params, f"request {request_id!r}")
        internal_id = llm._queue(token_ids, sp, text, stream=True)
        llm._owned.add(internal_id)
        self.ids[request_id] = internal_id
        return request_id

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests it advanced, as their kinds ask."""
        llm = self.llm
        if self.ids:
            llm._step()
        outputs = []
        for request_id, internal_id in list(self.ids.items()):
            request = llm.outputs.requests[internal_id]
            kind = request.completions[0].params.output_kind
            new = increments(request)
            if new and (kind != RequestOutputKind.FINAL_ONLY or request.finished):
                if kind == RequestOutputKind.DELTA:
                    output = self._delta(internal_id, request, new)
                else:
                    output = llm.outputs.request_output(internal_id)
                output.request_id = request_id
                outputs.append(output)
            if request.finished:
                self._forget(request_id)
                llm.outputs.pop(internal_id)
        if not self.ids:
            llm._process(llm.core.settle())  # nothing of ours is left in flight
        return outputs

    def _delta(self, internal_id: int, request, new: list) -> RequestOutput:
        completions = []
        for index, inc in new:
            c = request.completions[index]
            args = (c.cumulative_logprob, inc["logprobs"], c.finish_reason, c.stop_reason)
            completions.append(CompletionOutput(index, inc["text"], inc["token_ids"], *args))
        prompt_logprobs = next((inc["prompt_logprobs"] for i, inc in new if i == 0), None)
        return RequestOutput(
            str(internal_id),
            request.prompt,
            request.prompt_token_ids,
            prompt_logprobs,  # Logprob entries: detokenizer.increments ranks them
            completions,
            request.finished,
            request.completions[0].num_cached_tokens,
        )

    def _forget(self, request_id: str) -> None:
        self.llm._owned.discard(self.ids.pop(request_id))

    def abort_request(self, request_ids: str | list[str]) -> None:
        """End these requests (ids not in flight are ignored); they produce no more outputs."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            internal_id = self.ids.get(request_id)
            if internal_id is not None:
                self.llm.core.abort_request(internal_id)
                self._forget(request_id)
                self.llm.outputs.pop(internal_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.ids)

    def get_tokenizer(self):
        return self.llm.tokenizer

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.llm.reset_prefix_cache(reset_running_requests)

    def collective_rpc(self, method, timeout=None, args: tuple = (), kwargs=None) -> list:
        """``method`` on every rank (``timeout`` is not used: calls run to their end)."""
        return self.llm.collective_rpc(method, args, kwargs)

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm.get_default_sampling_params()

    def exit(self) -> None:
        self.llm.exit()
