"""The front end: inputs, the engine core, outputs (docs/frontend.md)."""

import atexit
from collections.abc import Iterator
from contextlib import closing
from itertools import count
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.core import EngineCore
from nanovllm.engine.input_processor import InputProcessor
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.runner.executor import Executor
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.interrupts import deferred_interrupt
from nanovllm.utils.model_folder import load_tokenizer, read_generation_config, sampling_defaults
from nanovllm.utils.profiling import phase

ASLEEP = "the engine is asleep; call wake_up()"
EXITED = "this LLM has exited (exit() or the end of its with block); create a new LLM to continue"


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        accepted = [name for name in Config.field_names() if name != "model"]
        if unknown := [key for key in kwargs if key not in accepted]:
            msg = f"unexpected keyword argument {unknown[0]!r}; accepted: {', '.join(accepted)}"
            raise TypeError(f"LLM() got an {msg}")
        self.config = config = Config(model, **kwargs)
        self.tokenizer = load_tokenizer(config.model)  # before any process starts
        self.generation_config = read_generation_config(config.model)
        found = (self.tokenizer.eos_token_id, getattr(config.hf_config, "eos_token_id", None))
        found += (self.generation_config.get("eos_token_id"),)
        eos = {e for x in found for e in (x if isinstance(x, (list, tuple)) else [x])}
        self.eos_token_ids = sorted(e for e in eos if e is not None)
        self._exited = True  # until the core has started
        if config.data_parallel_size > 1 or config.data_parallel_backend == "ray":
            from nanovllm.parallel.data_parallel import DataParallelCore

            self.core = DataParallelCore(config, self.eos_token_ids)
        else:
            self.core = EngineCore(config, self.eos_token_ids, Executor(config), self.tokenizer)
        self._exited = False
        atexit.register(self.exit)
        self.sleep_level = 0  # 0: awake; 1 or 2: asleep (features/sleep.py sets it)
        self.num_kvcache_blocks = self.core.num_kvcache_blocks
        self.inputs = InputProcessor(self.tokenizer, config, self.num_kvcache_blocks)
        self.outputs = OutputProcessor(self.tokenizer)
        self._request_ids = count()
        self._owned: set[int] = set()  # requests a generate/chat/stream call in flight takes
        self._unclaimed: list[tuple[int, list[int]]] = []  # add_request's, for step()'s caller
        self._final_stats: dict | None = None  # get_stats() once exited
        self.last_throughput = {"prefill": 0.0, "decode": 0.0}  # of the last generate call

    def exit(self) -> None:
        """Release processes, shared memory and the process group (idempotent); drop the queue."""
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        idle = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0}
        stats = self._final_stats = {**self.get_stats(), **idle}
        if "replicas" in stats:
            stats["replicas"] = [{**r, **idle} for r in stats["replicas"]]
        self._unclaimed, self._owned = [], set()
        self.outputs.requests.clear()
        self.core.exit()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.exit()

    def _check_running(self, asleep_ok: bool = False) -> None:
        if self._exited:
            raise RuntimeError(EXITED)
        if self.core.failure_message:
            raise RuntimeError(self.core.failure_message)
        if self.sleep_level and not asleep_ok:
            raise RuntimeError(ASLEEP)

    def check_idle(self, what: str) -> None:
        self._process(self.core.settle())
        if not self.core.is_finished():
            s = self.core.stats()
            raise RuntimeError(
                f"{what} needs an idle engine, but sequences are queued (running "
                f"{s['num_requests_running']}, waiting {s['num_requests_waiting']}): let them "
                "finish (generate, or step() until is_finished()) or abort them first"
            )

    # ---- requests and steps ------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:  # with generation_config.json's
        return SamplingParams(**sampling_defaults(self.generation_config))

    def _queue(self, token_ids: list[int], sp: SamplingParams, stream: bool = False) -> int:
        """Queue a checked request; completion i is ``request_id + i``."""
        request_id = next(self._request_ids)
        for _ in range(sp.n - 1):
            next(self._request_ids)
        every_step = self.outputs.add_request(request_id, token_ids, sp, stream)
        self.core.add_request(request_id, token_ids, sp, every_step)
        return request_id

    def add_request(self, prompt, sampling_params: SamplingParams) -> int:
        """Queue one request; returns its id (``step`` reports completion ``i`` as id + i)."""
        self._check_running()
        return self._queue(*self.inputs.check(prompt, sampling_params, "prompt"))

    def abort_request(self, request_id: int) -> bool:
        """False when no such request is queued."""
        if self._exited or not self.core.abort_request(request_id):
            return False
        self.outputs.abort(request_id)
        if request_id not in self._owned:
            self.outputs.pop(request_id)
        return True

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """``add_request``'s finished ``(seq_id, token_ids)``, and the prefill tokens (> 0) or minus
        the decoded sequences (< 0)."""
        _, num_tokens = self._step()
        outputs, self._unclaimed = self._unclaimed, []
        return outputs, num_tokens

    def _step(self) -> tuple[list[int], int]:  # the requests that finished, the step's tokens
        self._check_running()
        with deferred_interrupt():
            outputs, num_tokens = self.core.step()
            return self._process(outputs), num_tokens

    def _process(self, outputs: list) -> list[int]:  # the requests that finished with them
        with phase("outputs"):
            finished, stopped = self.outputs.process(outputs)
            for request_id, seq_id in stopped:
                self.core.finish_sequence(seq_id, request_id)
            for request_id, seq_id in finished:
                if request_id not in self._owned:
                    completion = self.outputs.requests[request_id].completions[seq_id - request_id]
                    self._unclaimed.append((seq_id, completion.token_ids))
            done = list(dict.fromkeys(r for r, _ in finished if self.outputs.is_finished(r)))
            for request_id in done:
                if request_id not in self._owned:
                    self.outputs.pop(request_id)
        return done

    def is_finished(self) -> bool:
        return self._exited or (self.core.is_finished() and not self._unclaimed)

    def get_stats(self) -> dict:
        if self._final_stats is not None:
            return dict(self._final_stats)
        rates = {f"{kind}_throughput": value for kind, value in self.last_throughput.items()}
        return {**self.core.stats(), **rates}

    # ---- every rank, weights, sleep, the prefix cache ----------------------------------------

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """``method`` on every rank of every replica; each replica's rank-0 result."""
        self._check_running(asleep_ok=True)
        return self.core.collective_rpc(method, args, kwargs)

    def update_weights(self, weights) -> None:
        """Load ``(name, tensor)`` pairs into the model in place."""
        from nanovllm.features.weight_update import update_weights

        self._check_running()
        update_weights(self, weights)

    def sleep(self, level: int = 1) -> None:
        """Free device memory; level 1 keeps the weights on the host."""
        from nanovllm.features.sleep import sleep

        self._check_running(asleep_ok=True)
        sleep(self, level)

    def wake_up(self) -> None:
        from nanovllm.features.sleep import wake_up

        self._check_running(asleep_ok=True)
        wake_up(self)

    def is_sleeping(self) -> bool:
        return self.sleep_level != 0

    def reset_prefix_cache(self) -> bool:
        self._check_running(asleep_ok=True)
        self._process(self.core.settle())  # with replicas: no call in flight
        return self.core.reset_prefix_cache()

    # ---- offline calls -----------------------------------------------------------------------

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[dict]:
        """One result dict per prompt, in input order."""
        self._check_running()
        requests = self.inputs.check_all(prompts, sampling_params, self.get_default_sampling_params)
        if not requests:
            return []
        results: dict[int, dict] = {}
        bar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        with bar, closing(self._run(requests)) as steps:
            shown = perf_counter()
            for request_ids, finished in steps:
                for request_id in finished:  # decoded while the device computes the next step
                    results[request_id] = self.outputs.request_output(request_id)
                bar.update(len(finished))
                if use_tqdm and perf_counter() - shown > 0.5:
                    shown = perf_counter()
                    bar.set_postfix({k: f"{v:.0f}tok/s" for k, v in self.last_throughput.items()})
        return [results[request_id] for request_id in request_ids]

    def chat(
        self, messages, sampling_params=None, use_tqdm=True, chat_template_kwargs=None
    ) -> list:
        self._check_running()
        prompts = self.inputs.chat_prompts(messages, chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompts, sampling_params=None) -> Iterator[dict]:
        """Per-step increments; prompts checked now, queued on iteration; closing aborts them."""
        self._check_running()
        requests = self.inputs.check_all(prompts, sampling_params, self.get_default_sampling_params)
        return self._stream(requests)

    def _stream(self, requests: list) -> Iterator[dict]:
        from nanovllm.engine.detokenizer import increments

        with closing(self._run(requests, stream=True)) as steps:
            for request_ids, _ in steps:
                for index, request_id in enumerate(request_ids):
                    for completion, inc in increments(self.outputs.requests[request_id]):
                        yield {"index": index, "completion": completion, **inc}

    def _run(self, requests: list, stream: bool = False) -> Iterator[tuple[list[int], list[int]]]:
        """Queue ``requests``, step until all finish; left early, it aborts the rest."""
        self._check_running()
        request_ids = [self._queue(token_ids, sp, stream) for token_ids, sp in requests]
        self._owned.update(request_ids)
        remaining = set(request_ids)
        tokens, seconds = {"prefill": 0, "decode": 0}, {"prefill": 0.0, "decode": 0.0}
        self.last_throughput = {"prefill": 0.0, "decode": 0.0}
        try:
            while remaining:
                t = perf_counter()
                done, num_tokens = self._step()
                kind = "prefill" if num_tokens > 0 else "decode"
                tokens[kind] += abs(num_tokens)
                seconds[kind] += perf_counter() - t
                self.last_throughput[kind] = tokens[kind] / seconds[kind]
                finished = [r for r in done if r in remaining]
                if num_tokens == 0:  # nothing ran: some of ours were aborted meanwhile
                    rest = remaining.difference(finished)
                    finished += [r for r in rest if self.outputs.is_finished(r)]
                remaining.difference_update(finished)
                yield request_ids, finished
        finally:
            self._owned.difference_update(request_ids)
            for request_id in request_ids:
                if not self.outputs.is_finished(request_id):
                    self.core.abort_request(request_id)
                self.outputs.pop(request_id)
            if not self.core.failure_message:  # the call ends with nothing of it in flight
                self._process(self.core.settle())
