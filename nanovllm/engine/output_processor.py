"""The front end's output side: completions as the core reports tokens; ``RequestOutput``s."""

from dataclasses import dataclass, field

from nanovllm.engine.core import SeqOutput
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams


@dataclass
class Completion:
    params: SamplingParams
    detokenizer: object = None  # IncrementalDetokenizer, for streams and stop strings
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0

    @property
    def num_text_tokens(self) -> int:
        """A final EOS or stop token id is in ``token_ids`` but not in the text (as in vLLM)."""
        stopped_by_id = self.finish_reason == "stop" and not isinstance(self.stop_reason, str)
        return len(self.token_ids) - (stopped_by_id and not self.params.include_stop_str_in_output)


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    completions: list[Completion]
    prompt: str | None = None  # the prompt's text, when it was given as text
    prompt_logprobs: list | None = None  # once the core sends them
    prompt_logprobs_sent: bool = False  # a stream sends them in completion 0's first increment
    lora_request: object = None  # the LoRARequest it runs with

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[int, RequestState] = {}
        self.token_texts: dict[int, str] = {}  # decoded tokens of logprobs, as they are asked for

    def add_request(self, request_id: int, prompt_token_ids, sp, stream, prompt=None, lora=None):
        """Whether the core must report the request's tokens every step."""
        text_each_step = stream or bool(sp.stop)
        completions = [Completion(sp) for _ in range(sp.n)]
        for c in completions:
            if text_each_step:
                from nanovllm.engine.detokenizer import IncrementalDetokenizer

                c.detokenizer = IncrementalDetokenizer(self.tokenizer, sp)
            if sp.logprobs is not None:
                c.logprobs, c.cumulative_logprob = [], 0.0
        self.requests[request_id] = RequestState(
            prompt_token_ids, completions, prompt, lora_request=lora
        )
        return text_each_step or sp.logprobs is not None

    def process(self, outputs: list[SeqOutput]) -> tuple[list, list]:
        """``(request_id, seq_id)`` of finished completions, and of those a stop string ended."""
        finished, stopped = [], []
        for out in outputs:
            request = self.requests.get(out.request_id)
            if request is None:
                continue
            if out.prompt_logprobs is not None:
                request.prompt_logprobs = out.prompt_logprobs
            c = request.completions[out.seq_id - out.request_id]
            if c.finished:
                continue
            c.token_ids += out.new_token_ids
            c.num_cached_tokens = out.num_cached_tokens
            for logprob, entry in out.new_logprobs or ():
                c.cumulative_logprob += logprob
                c.logprobs.append(entry)
            if out.finish_reason is not None:
                c.finished, c.finish_reason = True, out.finish_reason
                c.stop_reason = out.stop_reason
            if (
                c.detokenizer is not None
                and out.new_token_ids
                and c.detokenizer.stop_string(c, out.new_token_ids)
            ):
                if out.finish_reason is None:
                    stopped.append((out.request_id, out.seq_id))
                    c.finished = True
            if c.finished:
                finished.append((out.request_id, out.seq_id))
        return finished, stopped

    def abort(self, request_id: int) -> None:
        for c in self.requests[request_id].completions:
            if not c.finished:
                c.finished, c.finish_reason = True, "abort"

    def is_finished(self, request_id: int) -> bool:
        request = self.requests.get(request_id)
        return request is None or request.finished

    def pop(self, request_id: int) -> RequestState | None:
        return self.requests.pop(request_id, None)

    def request_output(self, request_id: int) -> RequestOutput:
        request = self.requests[request_id]
        return RequestOutput(
            str(request_id),
            request.prompt,
            request.prompt_token_ids,
            self._ranked(request.prompt_logprobs, request.completions[0].params),
            [self._completion(i, c) for i, c in enumerate(request.completions)],
            request.finished,
            request.completions[0].num_cached_tokens,
            lora_request=request.lora_request,
        )

    def _completion(self, index: int, c: Completion) -> CompletionOutput:
        if c.detokenizer is not None:
            text = c.detokenizer.final_text()
        else:
            ids = c.token_ids[: c.num_text_tokens if c.params.detokenize else 0]  # False: no text
            text = self.tokenizer.decode(ids, skip_special_tokens=c.params.skip_special_tokens)
        args = (c.cumulative_logprob, self._ranked(c.logprobs, c.params), c.finish_reason)
        return CompletionOutput(index, text, list(c.token_ids), *args, c.stop_reason)

    def _ranked(self, entries: list | None, params) -> list | None:
        if entries is None:
            return None
        from nanovllm.logprobs import ranked

        return ranked(entries, self.tokenizer if params.detokenize else None, self.token_texts)
