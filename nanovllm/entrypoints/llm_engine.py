"""vLLM's ``LLMEngine``: ``add_request(request_id, prompt, params)``, then ``step()`` until
``has_unfinished_requests()`` is False; each step's ``RequestOutput``s follow the request's
``params.output_kind``."""

from nanovllm.engine.arg_utils import from_engine_args
from nanovllm.entrypoints.output_kinds import Live, request_output
from nanovllm.entrypoints.step_loop import checked
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class LLMEngine:
    """A step loop over an ``LLM`` (``self.llm``) with the caller's string request ids."""

    from_engine_args = classmethod(from_engine_args)

    def __init__(self, model: str, **kwargs):
        from nanovllm.llm import LLM

        self.llm = LLM(model, **kwargs)
        self.live: dict[str, Live] = {}  # the caller's id of each unfinished request -> its stream

    def add_request(self, request_id: str, prompt, params, arrival_time=None, lora_request=None):
        """Queue one request; ``prompt``: a str, token ids or a prompt dict."""
        llm = self.llm
        llm._check_running()
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.live:
            raise ValueError(f"request_id {request_id!r} is in use by an unfinished request")
        if not isinstance(params, SamplingParams):
            msg = "a SamplingParams (pooling is not supported)"
            raise TypeError(f"params must be {msg}, got {type(params).__name__}")
        request = llm.inputs.check(prompt, params, f"request {request_id!r}")
        sp = request[1]
        internal_id = llm._queue(*checked(llm, request, lora_request), stream=True)
        llm._owned.add(internal_id)
        self.live[request_id] = Live(request_id, None, None, sp.output_kind, sp.n, internal_id)
        return request_id

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests it advanced, as their kinds ask."""
        llm = self.llm
        if self.live:
            llm._step()
        outputs = []
        for request_id, live in list(self.live.items()):
            if (output := request_output(llm, live)) is not None:
                outputs.append(output)
            if llm.outputs.is_finished(live.rid):
                self._forget(request_id)
        if not self.live:
            llm._process(llm.core.settle())  # nothing of ours is left in flight
        return outputs

    def _forget(self, request_id: str) -> None:
        rid = self.live.pop(request_id).rid
        self.llm._owned.discard(rid)
        self.llm.outputs.pop(rid)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """End these requests (ids not in flight are ignored); they produce no more outputs."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if (live := self.live.get(request_id)) is not None:
                self.llm.core.abort_request(live.rid)
                self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def get_num_unfinished_requests(self) -> int:
        return len(self.live)

    def get_tokenizer(self):
        return self.llm.tokenizer

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.llm.reset_prefix_cache(reset_running_requests)

    def collective_rpc(self, method, timeout=None, args: tuple = (), kwargs=None) -> list:
        """``method`` on every rank (``timeout`` is not used: calls run to their end)."""
        return self.llm.collective_rpc(method, args, kwargs)

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm.get_default_sampling_params()

    def add_lora(self, lora_request) -> bool:
        return self.llm.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        return self.llm.pin_lora(lora_id)

    def exit(self) -> None:
        self.live.clear()
        self.llm.exit()
