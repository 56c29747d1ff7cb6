"""vLLM's ``AsyncLLM``: asyncio streams over an ``LLM`` stepped in a background thread
(docs/async.md)."""

import asyncio
import atexit
import dataclasses
from collections.abc import AsyncGenerator, Iterable

from nanovllm.entrypoints.engine_thread import PAUSE_MODES, EngineThread, RetryableRequestError
from nanovllm.entrypoints.output_kinds import Live, accumulate
from nanovllm.llm import LLM
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncLLM", "RetryableRequestError"]
SHUT_DOWN = "this AsyncLLM has been shut down (shutdown()); create a new one to continue"


class Collector:
    """A stream's output not yet taken; DELTA outputs merge while the consumer lags."""

    def __init__(self, kind):
        self.merge = kind == RequestOutputKind.DELTA
        self.item: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException | None) -> None:
        if item is None or isinstance(self.item, BaseException):
            return  # the error is what the consumer hears
        if self.merge and self.item is not None and isinstance(item, RequestOutput):
            item = merged(self.item, item)
        self.item = item
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.item is None:
            await self.ready.wait()
        item, self.item = self.item, None
        self.ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item


def merged(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Two DELTA outputs of one request as one: texts, token ids and logprobs joined."""
    by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        before = by_index.get(c.index)
        by_index[c.index] = c if before is None else accumulate(before, c)
    prompt_logprobs = old.prompt_logprobs or new.prompt_logprobs
    outputs = sorted(by_index.values(), key=lambda c: c.index)
    return dataclasses.replace(new, outputs=outputs, prompt_logprobs=prompt_logprobs)


def _refuse(name: str, value, allowed: str) -> None:
    raise ValueError(f"AsyncLLM: {name}={value!r} is not supported; {allowed}")


class AsyncLLM:
    """``AsyncLLM(model, **LLM kwargs)``: ``async for out in engine.generate(prompt, params, id)``
    from many tasks at once; the engine runs in one daemon thread (see docs/async.md)."""

    def __init__(self, model: str, **kwargs):
        self._closed = False
        self.llm = LLM(model, **kwargs)
        self._engine = EngineThread(self.llm)
        self._streams: dict[str, Collector] = {}  # the live requests' ids
        atexit.register(self.shutdown)

    @classmethod
    def from_engine_args(
        cls, engine_args, start_engine_loop=True, usage_context=None, stat_loggers=None
    ) -> "AsyncLLM":
        """An engine with the fields of ``engine_args`` (``model`` and ``LLM``'s keywords)."""
        if start_engine_loop is not True:
            _refuse("start_engine_loop", start_engine_loop, "the engine thread always starts")
        if stat_loggers is not None:
            _refuse("stat_loggers", stat_loggers, "use get_stats(); only None is accepted")
        if callable(getattr(engine_args, "llm_kwargs", None)):  # EngineArgs: its LLM() keywords
            kwargs = dict(engine_args.llm_kwargs())
        elif dataclasses.is_dataclass(engine_args):
            kwargs = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
        else:
            kwargs = dict(vars(engine_args))
        return cls(kwargs.pop("model"), **kwargs)

    # ---- requests ----------------------------------------------------------------------------

    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        lora_request=None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        trace_headers=None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as ``sampling_params.output_kind`` says; the last one has
        ``finished=True``. Leaving the loop early (or cancelling the task) aborts the request."""
        self._check_open()
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        for name, value, default in (
            ("priority", priority, 0),
            ("data_parallel_rank", data_parallel_rank, None),
        ):
            if value != default:
                _refuse(name, value, f"only {default!r} (the engine serves in FIFO order)")
        if isinstance(sampling_params, SamplingParams):
            sampling_params = sampling_params.snapshot()  # later changes by the caller: not seen
        kind = getattr(sampling_params, "output_kind", RequestOutputKind.CUMULATIVE)
        collector = Collector(kind)
        live = Live(request_id, collector, asyncio.get_running_loop(), kind, 1)
        self._streams[request_id] = collector
        try:
            self._engine.post(self._engine.add, live, prompt, sampling_params, lora_request)
            while True:
                out = await collector.get()
                if out.finished:  # the id is free again as soon as the last output is out
                    del self._streams[request_id]
                    yield out
                    return
                yield out
        finally:
            if self._streams.get(request_id) is collector:  # left early: the request ends
                del self._streams[request_id]
                if not self._closed and self._engine.dead is None:
                    self._engine.post(self._engine.abort, [request_id])

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """End requests; each stream gets a last output with finish_reason "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self._call(self._engine.abort, ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self._streams)

    # ---- pause, weights, caches --------------------------------------------------------------

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop stepping. "abort": end every request now; "wait": let the running ones finish;
        "keep": hold them (and new ones) until ``resume_generation``. New requests are refused
        (``RetryableRequestError``) under "abort" and "wait"."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation: mode={mode!r}; allowed: {', '.join(PAUSE_MODES)}")
        if not isinstance(clear_cache, bool):
            raise TypeError(f"pause_generation: clear_cache must be a bool, got {clear_cache!r}")
        self._check_open()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._engine.post(self._engine.pause, mode, clear_cache, (loop, future))
        await future

    async def resume_generation(self) -> None:
        await self._call(self._engine.resume)

    async def is_paused(self) -> bool:
        return self._engine.paused is not None

    async def update_weights(self, weights) -> None:
        """``LLM.update_weights(weights)`` on the engine thread: ``(name, tensor)`` pairs. Needs no
        request in flight: pause first (requests kept by mode "keep" go on with the new weights)."""
        await self._call(self.llm.update_weights, weights)

    async def collective_rpc(self, method, timeout=None, args: tuple = (), kwargs=None) -> list:
        """``method`` on every rank, between steps; ``timeout`` (s): stop waiting for it."""
        return await asyncio.wait_for(
            self._call(self.llm.collective_rpc, method, args, kwargs), timeout
        )

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False) -> bool:
        if reset_running_requests is not False:
            msg = "only False (blocks of running requests stay until they end)"
            _refuse("reset_running_requests", reset_running_requests, msg)
        return await self._call(self.llm.reset_prefix_cache)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pause (``mode``), then ``LLM.sleep(level)``; a refused sleep resumes generation."""
        from nanovllm.features.sleep import check_level

        check_level(level)
        if not self.llm.config.enable_sleep_mode:
            raise RuntimeError(
                "sleep() needs sleep mode: create the engine with enable_sleep_mode=True"
            )
        await self.pause_generation(mode=mode)
        try:
            await self._call(self.llm.sleep, level)
        except BaseException:
            await self.resume_generation()
            raise

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        if tags is not None:
            _refuse("tags", tags, "only None (weights and KV cache wake up together)")
        await self._call(self.llm.wake_up)
        await self.resume_generation()
        return True

    async def is_sleeping(self) -> bool:
        return await self._call(self.llm.is_sleeping)

    async def add_lora(self, lora_request) -> bool:
        return await self._call(self.llm.add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call(self.llm.remove_lora, lora_id)

    async def list_loras(self) -> set[int]:
        return await self._call(self.llm.list_loras)

    async def pin_lora(self, lora_id: int) -> bool:
        return await self._call(self.llm.pin_lora, lora_id)

    async def get_stats(self) -> dict:
        """``LLM.get_stats()``, read on the engine thread."""
        return await self._call(self.llm.get_stats)

    # ---- the engine's state --------------------------------------------------------------------

    def get_tokenizer(self):
        return self.llm.tokenizer

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def is_running(self) -> bool:
        return not self._closed and self._engine.dead is None

    @property
    def is_stopped(self) -> bool:
        return not self.is_running

    @property
    def errored(self) -> bool:
        return not self._closed and self._engine.dead is not None

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError(SHUT_DOWN) if self._closed else self._engine.dead

    async def check_health(self) -> None:
        self._check_open()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine thread and release the engine (idempotent)."""
        if self._closed or getattr(self, "_engine", None) is None:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self._engine.stop(60.0 if timeout is None else timeout)

    def __del__(self):
        if getattr(self, "_engine", None) is not None:
            self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(SHUT_DOWN)
        if self._engine.dead is not None:
            raise RuntimeError(str(self._engine.dead)) from self._engine.dead

    async def _call(self, fn, *args):
        """``fn(*args)`` on the engine thread, awaited."""
        self._check_open()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._engine.post(fn, *args, reply=(loop, future))
        return await future
