"""The offline calls: ``generate``, ``chat`` and ``stream``, over the engine's step loop.

Each call checks every prompt before it queues any, and ends its own unfinished requests when it
is left early: an exception (Ctrl-C included) or a stream closed before its end.
"""
from collections.abc import Iterator
from contextlib import closing
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.engine.requests import Request, as_prompt_list
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

PROGRESS_INTERVAL = 0.5  # seconds between progress-bar throughput updates


class OfflineCalls:
    """Mixed into ``LLMEngine``: uses its ``step``, ``_make_request``, ``_queue``,
    ``abort_request``, ``tokenizer`` and call bookkeeping."""

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Complete every prompt (a string or a 1-D sequence of token ids, or a list of them);
        returns one dict per prompt, in input order. ``sampling_params``: one for all, one per
        prompt, or None for ``get_default_sampling_params()``."""
        requests = self._make_requests(prompts, sampling_params)
        where = {seq.seq_id: i for i, request in enumerate(requests) for seq in request.seqs}
        results: list[dict | None] = [None] * len(requests)
        pbar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        with pbar, closing(self._run(requests)) as steps:
            shown = perf_counter()
            for finished in steps:
                # a request's output (its text decoded) is made when it finishes, while the device
                # computes the next step, not after the last one
                for seq_id in finished:
                    i = where[seq_id]
                    if results[i] is None and requests[i].is_finished:
                        results[i] = self._request_output(requests[i])
                        pbar.update(1)
                if use_tqdm and perf_counter() - shown > PROGRESS_INTERVAL:
                    shown = perf_counter()
                    t = self.last_throughput
                    pbar.set_postfix(prefill=f"{t['prefill']:.0f}tok/s", decode=f"{t['decode']:.0f}tok/s")
        return [self._request_output(r) if out is None else out for out, r in zip(results, requests)]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None) -> list[dict]:
        """``generate`` over conversations (one, or a list of them; each a list of ``{"role",
        "content"}`` dicts) through the tokenizer's chat template, with the assistant's turn opened.
        ``chat_template_kwargs`` go to the template (Qwen3: ``enable_thinking=False``)."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"messages must be a conversation or a list of conversations, got {type(messages).__name__}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict or None, got {type(chat_template_kwargs).__name__}")
        prompts = [self._chat_prompt(c, i, chat_template_kwargs or {}) for i, c in enumerate(messages)]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_prompt(self, conversation, i: int, template_kwargs: dict) -> list[int]:
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise TypeError(f"messages[{i}]: a conversation must be a non-empty list of message dicts, got {conversation!r}")
        for j, m in enumerate(conversation):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise TypeError(f"messages[{i}][{j}]: a message must be a dict with str 'role' and 'content', got {m!r}")
        encoded = self.tokenizer.apply_chat_template(
            list(conversation), add_generation_prompt=True, tokenize=True, return_dict=True, **template_kwargs
        )
        return list(encoded["input_ids"])

    def stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[dict]:
        """Like ``generate``, as an iterator of per-step increments, each a dict with ``index`` (the
        prompt's position), ``completion`` (its index among ``n``), ``token_ids`` and ``text`` (new
        since the last increment; text never ends inside a character or a possible stop string),
        ``logprobs`` (new entries, or None), ``finished``, and once finished ``finish_reason`` and
        ``stop_reason``. Prompts are checked now; they are queued when iteration starts, and closing
        the iterator early (``break``) aborts the unfinished ones."""
        return self._stream(self._make_requests(prompts, sampling_params, stream=True))

    def _stream(self, requests: list[Request]) -> Iterator[dict]:
        with closing(self._run(requests)) as steps:
            for _ in steps:
                for index, request in enumerate(requests):
                    for completion, seq in enumerate(request.seqs):
                        if (increment := self._increment(seq)) is not None:
                            yield {"index": index, "completion": completion, **increment}

    @staticmethod
    def _increment(seq: Sequence) -> dict | None:
        d = seq.detokenizer
        done = seq.is_complete
        if d.sent_final or (d.sent_tokens == len(d.token_ids) and not done):
            return None  # done, or nothing new
        start = d.sent_tokens
        token_ids, text = d.take_increment(done)
        out = {"token_ids": token_ids, "text": text, "finished": done,
               "logprobs": None if seq.logprobs is None else seq.logprobs[start : start + len(token_ids)]}
        if done:
            out["finish_reason"], out["stop_reason"] = seq.finish_reason, seq.stop_reason
        return out

    # ---- shared --------------------------------------------------------------------------------

    def _make_requests(self, prompts, sampling_params, stream: bool = False) -> list[Request]:
        """Check every prompt and its params; nothing is queued."""
        prompts = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(sampling_params)} entries but there are {len(prompts)} prompts"
                )
        else:
            sampling_params = [sampling_params] * len(prompts)
        return [self._make_request(p, sp, f"prompts[{i}]", stream) for i, (p, sp) in enumerate(zip(prompts, sampling_params))]

    def _run(self, requests: list[Request]) -> Iterator[list[int]]:
        """Queue ``requests`` and step until all are finished, yielding after each step the ids of
        their sequences whose results became complete in it. Left early (an exception, or
        closed), it aborts whatever of them is unfinished."""
        own = {seq.seq_id for r in requests for seq in r.seqs}
        self._collected |= own
        for request in requests:
            self._queue(request)
        tokens = {"prefill": 0, "decode": 0}
        seconds = {"prefill": 0.0, "decode": 0.0}
        self.last_throughput = {"prefill": 0.0, "decode": 0.0}
        remaining = len(own)
        try:
            while remaining:
                t = perf_counter()
                outputs, num_tokens = self.step()
                kind = "prefill" if num_tokens > 0 else "decode"
                tokens[kind] += abs(num_tokens)
                seconds[kind] += perf_counter() - t
                self.last_throughput[kind] = tokens[kind] / seconds[kind]
                finished = []
                for seq_id, token_ids in outputs:
                    if seq_id in own:
                        finished.append(seq_id)
                    elif seq_id not in self._collected:
                        self._unclaimed.append((seq_id, token_ids))  # an add_request's: for step()'s caller
                remaining -= len(finished)
                if num_tokens == 0:  # nothing ran: some of ours were aborted meanwhile
                    remaining = sum(not seq.is_complete for r in requests for seq in r.seqs)
                yield finished
            self._settle()
        finally:
            self._collected -= own
            for request in requests:
                if request.request_id in self._requests:  # not all its results are out
                    self.abort_request(request.request_id)

    def _request_output(self, request: Request) -> dict:
        completions = [self._completion_output(i, seq) for i, seq in enumerate(request.seqs)]
        first = {k: v for k, v in completions[0].items() if k != "index"}
        return {**first, "prompt_token_ids": request.prompt_token_ids,
                "num_cached_tokens": request.seqs[0].num_prefix_hit_tokens, "outputs": completions}

    def _completion_output(self, index: int, seq: Sequence) -> dict:
        token_ids = seq.completion_token_ids
        if seq.detokenizer is not None:
            text = seq.detokenizer.final_text()
        else:
            text = self.tokenizer.decode(
                token_ids[: seq.num_text_tokens], skip_special_tokens=seq.sampling_params.skip_special_tokens
            )
        return {"index": index, "text": text, "token_ids": token_ids, "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason, "logprobs": seq.logprobs, "cumulative_logprob": seq.cumulative_logprob}
