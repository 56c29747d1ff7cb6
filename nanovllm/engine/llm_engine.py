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
from nanovllm.outputs import RequestOutput
from nanovllm.runner.executor import Executor
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.interrupts import deferred_interrupt
from nanovllm.utils.model_folder import load_tokenizer, read_generation_config, sampling_defaults
from nanovllm.utils.profiling import phase

ASLEEP = "the engine is asleep; call wake_up()"
EXITED = "this LLM has exited (exit() or the end of its with block); create a new LLM to continue"


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        if any(key not in Config.field_names() for key in kwargs):  # vLLM's names and values
            from nanovllm.entrypoints.options import config_kwargs

            kwargs = config_kwargs(kwargs)
        self.config = config = Config(model, **kwargs)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)  # before any process
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
        self._final_stats: dict | None = None
        self.last_throughput = {"prefill": 0.0, "decode": 0.0}  # of the last generate call

    def exit(self) -> None:
        """Release processes, shared memory and the process group (idempotent); drop the queue."""
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        self._unclaimed, self._owned = [], set()
        self.outputs.requests.clear()
        try:
            self._final_stats = self.core.stats()  # get_stats() once exited
        finally:  # a dead replica's stats may raise: the processes still end
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

    # ---- requests and steps ------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:  # with generation_config.json's
        return SamplingParams(**sampling_defaults(self.generation_config))

    def _queue(self, token_ids: list[int], sp: SamplingParams, text=None, lora=None, stream=False):
        """Queue a checked request; completion i is ``request_id + i``; ``lora``: its adapter."""
        request_id = next(self._request_ids)
        for _ in range(sp.n - 1):
            next(self._request_ids)
        every_step = self.outputs.add_request(request_id, token_ids, sp, stream, text, lora)
        self.core.add_request(request_id, token_ids, sp, every_step, lora)
        return request_id

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

    # ---- offline calls -----------------------------------------------------------------------

    def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None) -> list:
        """One ``RequestOutput`` per prompt, in input order."""
        self._check_running()
        requests = self.inputs.check_all(prompts, sampling_params, self.get_default_sampling_params)
        if lora_request is not None:  # one adapter, or one per prompt (nanovllm/lora/)
            from nanovllm.lora.api import with_adapters

            requests = with_adapters(self, requests, lora_request)
        if not requests:
            return []
        results: dict[int, RequestOutput] = {}
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

    def _run(self, requests: list, stream: bool = False) -> Iterator[tuple[list[int], list[int]]]:
        """Queue ``requests``, step until all finish; left early, it aborts the rest."""
        self._check_running()
        request_ids = [self._queue(*request, stream=stream) for request in requests]
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
