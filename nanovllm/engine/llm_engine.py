"""The front end: prompts in (``InputProcessor``), outputs out (``OutputProcessor``), and between
them the engine core, which runs on token ids only (``EngineCore``)."""

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
PROGRESS_INTERVAL = 0.5  # seconds between progress-bar throughput updates


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        accepted = [name for name in Config.field_names() if name != "model"]
        for key in kwargs:
            if key not in accepted:
                raise TypeError(
                    f"LLM() got an unexpected keyword argument {key!r}; accepted: {', '.join(accepted)}"
                )
        self.config = config = Config(model, **kwargs)
        self.tokenizer = load_tokenizer(config.model)  # before any process starts
        self.generation_config = read_generation_config(config.model)
        eos = {
            self.tokenizer.eos_token_id,
            *_as_list(getattr(config.hf_config, "eos_token_id", None)),
            *_as_list(self.generation_config.get("eos_token_id")),
        }
        self.eos_token_ids = sorted(e for e in eos if e is not None)
        self.vocab_size = config.hf_config.vocab_size
        self._exited = True  # until the core has started
        self.sleep_level = 0  # 0: awake; 1 or 2: asleep at that level (features.sleep)
        if config.data_parallel_size > 1 or config.data_parallel_backend == "ray":
            from nanovllm.parallel.data_parallel import DataParallelCore

            self.core = DataParallelCore(config, self.eos_token_ids)
        else:
            self.core = EngineCore(config, self.eos_token_ids, Executor(config), self.tokenizer)
        self._exited = False
        atexit.register(self.exit)
        self.num_kvcache_blocks = self.core.num_kvcache_blocks
        self.inputs = InputProcessor(
            self.tokenizer,
            self.vocab_size,
            config.max_model_len,
            config.kvcache_block_size,
            self.num_kvcache_blocks,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self._request_ids = count()
        self._owned: set[int] = (
            set()
        )  # requests whose results a generate/chat/stream call in flight takes
        self._unclaimed: list[
            tuple[int, list[int]]
        ] = []  # finished add_request completions, for step()'s caller
        self.last_throughput = {
            "prefill": 0.0,
            "decode": 0.0,
        }  # tokens/s of the last generate/chat/stream

    def exit(self) -> None:
        """Release worker processes, shared memory and the process group (idempotent)."""
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        self.core.exit()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.exit()

    def _check_running(self, asleep_ok: bool = False) -> None:
        if self._exited:
            raise RuntimeError(
                "this LLM has exited (exit() or the end of its with block); create a new LLM to continue"
            )
        if self.core.failure_message:
            raise RuntimeError(self.core.failure_message)
        if self.sleep_level and not asleep_ok:
            raise RuntimeError(ASLEEP)

    def check_idle(self, what: str) -> None:
        """Let a step that computes only past its sequences' ends finish; then nothing may be queued."""
        self._process(self.core.settle())
        if not self.core.is_finished():
            stats = self.core.stats()
            raise RuntimeError(
                f"{what} needs an idle engine, but sequences are queued (running {stats['num_requests_running']}, "
                f"waiting {stats['num_requests_waiting']}): let them finish (generate, or step() until "
                f"is_finished()) or abort them first"
            )

    # ---- requests and steps ------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """What the model folder's ``generation_config.json`` recommends (temperature, top_p, top_k,
        min_p, repetition_penalty, and max_new_tokens as max_tokens), over ``SamplingParams()``'s
        defaults; used when a call passes no sampling params."""
        return SamplingParams(**sampling_defaults(self.generation_config))

    def _queue(
        self, token_ids: list[int], sampling_params: SamplingParams, stream: bool = False
    ) -> int:
        """Start a checked request's output state and queue it in the core. Its completion ``i``
        is sequence ``request_id + i``."""
        request_id = next(self._request_ids)
        for _ in range(sampling_params.n - 1):
            next(self._request_ids)
        every_step = self.outputs.add_request(request_id, token_ids, sampling_params, stream)
        self.core.add_request(request_id, token_ids, sampling_params, every_step)
        return request_id

    def add_request(self, prompt, sampling_params: SamplingParams) -> int:
        """Queue one request; returns its request id, which is the sequence id ``step`` reports
        (with ``n > 1``, completion ``i`` is reported as ``request_id + i``)."""
        self._check_running()
        return self._queue(self.inputs.check(prompt, sampling_params, "prompt"), sampling_params)

    def abort_request(self, request_id: int) -> bool:
        """End a waiting or running request and free its blocks; its completions are not reported.
        Returns False when no such request is queued (unknown, or already finished)."""
        if self._exited or not self.core.abort_request(request_id):
            return False
        self.outputs.abort(request_id)
        if request_id not in self._owned:
            self.outputs.pop(request_id)
        return True

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """Run one scheduled step. Returns the ``(seq_id, completion_token_ids)`` of the sequences
        of ``add_request``'s requests that finished (with async scheduling, by the tokens of the step
        before), and the prefill tokens this step computes (> 0) or minus the sequences it decodes
        (< 0; 0 when none was launched). Ctrl-C during a step takes effect when it is complete."""
        _, num_tokens = self._step()
        outputs, self._unclaimed = self._unclaimed, []
        return outputs, num_tokens

    def _step(self) -> tuple[list[int], int]:
        """One core step and its outputs; returns the requests that finished and the step's tokens."""
        self._check_running()
        with deferred_interrupt():
            outputs, num_tokens = self.core.step()
            return self._process(outputs), num_tokens

    def _process(self, outputs: list) -> list[int]:
        """Take the core's outputs; returns the requests that finished with them."""
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
        return self.core.is_finished() and not self._unclaimed

    def get_stats(self) -> dict:
        """Counts now (sequences: a request with ``n`` completions counts ``n``), cumulative
        token counts, and the last generate/chat/stream call's prefill and decode tokens/s."""
        return {
            **self.core.stats(),
            "prefill_throughput": self.last_throughput["prefill"],
            "decode_throughput": self.last_throughput["decode"],
        }

    # ---- weights and the prefix cache --------------------------------------------------------

    def update_weights(self, weights) -> None:
        """Copy new weights into the model in place, on every tensor-parallel rank and every
        data-parallel replica, and drop the prefix cache (its KV came from the old weights): for
        RL rollouts between training steps. ``weights``: ``(name, tensor)`` pairs under the
        checkpoint's Hugging Face names (a trainer's ``model.state_dict().items()``, or any subset),
        or a mapping of them; read once (a generator is fine); tensors on any device, in any
        floating-point dtype. Fused projections, experts and tensor-parallel shards load as from
        the checkpoint's files.

        All or nothing: every tensor is checked before any is written; an unknown name or a shape
        that config.json does not imply is a ValueError naming the tensor and both shapes, a pair
        that is not a name and a floating-point tensor a TypeError, and the engine is unchanged.
        Only between requests: with any request queued or running it is a RuntimeError (let them
        finish, or abort them, first)."""
        from nanovllm.features.weight_update import update_weights

        self._check_running()
        update_weights(self, weights)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, on every replica: later requests hit nothing cached so far
        (requests running now keep their blocks). Returns True."""
        self._check_running(asleep_ok=True)
        self._process(
            self.core.settle()
        )  # with replicas: no call in flight, so each takes this one
        return self.core.reset_prefix_cache()

    # ---- sleep mode (features/sleep.py) ----------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the device memory the engine holds, for a trainer that shares the GPUs: the KV
        cache, the CUDA graphs and the weights, on every rank and replica. Level 1 keeps the
        weights in host memory for ``wake_up``; level 2 drops them (load new ones with
        ``update_weights`` after ``wake_up``). The prefix cache is dropped. Needs
        ``enable_sleep_mode=True``, an awake engine and no request queued (else a RuntimeError)."""
        from nanovllm.features.sleep import sleep

        self._check_running(asleep_ok=True)
        sleep(self, level)

    def wake_up(self) -> None:
        """Reallocate the weights (level 1's restored; level 2's undefined until ``update_weights``),
        the KV cache with as many blocks as before, and the CUDA graphs. A no-op while awake."""
        from nanovllm.features.sleep import wake_up

        self._check_running(asleep_ok=True)
        wake_up(self)

    def is_sleeping(self) -> bool:
        return bool(self.sleep_level)

    # ---- offline calls -----------------------------------------------------------------------

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict]:
        """Complete every prompt (a string or a 1-D sequence of token ids, or a list of them);
        returns one dict per prompt, in input order. ``sampling_params``: one for all, one per
        prompt, or None for ``get_default_sampling_params()``. Every prompt is checked first."""
        self._check_running()
        requests = self.inputs.check_all(prompts, sampling_params, self.get_default_sampling_params)
        results: dict[int, dict] = {}
        pbar = tqdm(
            total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm
        )
        with pbar, closing(self._run(requests)) as steps:
            shown = perf_counter()
            for request_ids, finished in steps:
                # a request's output (its text decoded) is made when it finishes, while the device
                # computes the next step
                for request_id in finished:
                    results[request_id] = self.outputs.request_output(request_id)
                pbar.update(len(finished))
                if use_tqdm and perf_counter() - shown > PROGRESS_INTERVAL:
                    shown = perf_counter()
                    t = self.last_throughput
                    pbar.set_postfix(
                        prefill=f"{t['prefill']:.0f}tok/s", decode=f"{t['decode']:.0f}tok/s"
                    )
        return [results[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params=None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[dict]:
        """``generate`` over conversations (one, or a list of them; each a list of ``{"role",
        "content"}`` dicts) through the tokenizer's chat template, with the assistant's turn opened.
        ``chat_template_kwargs`` go to the template (Qwen3: ``enable_thinking=False``)."""
        self._check_running()
        return self.generate(
            self.inputs.chat_prompts(messages, chat_template_kwargs), sampling_params, use_tqdm
        )

    def stream(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> Iterator[dict]:
        """Like ``generate``, as an iterator of per-step increments, each a dict with ``index`` (the
        prompt's position), ``completion`` (its index among ``n``) and ``OutputProcessor.increments``'
        keys. Prompts are checked now; they are queued when iteration starts, and closing the
        iterator early (``break``) aborts the unfinished ones."""
        self._check_running()
        return self._stream(
            self.inputs.check_all(prompts, sampling_params, self.get_default_sampling_params)
        )

    def _stream(self, requests: list[tuple[list[int], SamplingParams]]) -> Iterator[dict]:
        with closing(self._run(requests, stream=True)) as steps:
            for request_ids, _ in steps:
                for index, request_id in enumerate(request_ids):
                    for completion, increment in self.outputs.increments(request_id):
                        yield {"index": index, "completion": completion, **increment}

    def _run(
        self, requests: list[tuple[list[int], SamplingParams]], stream: bool = False
    ) -> Iterator[tuple[list[int], list[int]]]:
        """Queue ``requests`` and step until all are finished, yielding after each step their
        request ids and those that finished in it. Left early (an exception, or closed), it aborts
        whatever of them is unfinished."""
        self._check_running()
        request_ids = [self._queue(token_ids, sp, stream) for token_ids, sp in requests]
        self._owned.update(request_ids)
        remaining = set(request_ids)
        tokens = {"prefill": 0, "decode": 0}
        seconds = {"prefill": 0.0, "decode": 0.0}
        self.last_throughput = {"prefill": 0.0, "decode": 0.0}
        try:
            while remaining:
                t = perf_counter()
                done, num_tokens = self._step()
                kind = "prefill" if num_tokens > 0 else "decode"
                tokens[kind] += abs(num_tokens)
                seconds[kind] += perf_counter() - t
                self.last_throughput[kind] = tokens[kind] / seconds[kind]
                finished = [request_id for request_id in done if request_id in remaining]
                if num_tokens == 0:  # nothing ran: some of ours were aborted meanwhile
                    finished += [
                        r for r in remaining if self.outputs.is_finished(r) and r not in finished
                    ]
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
