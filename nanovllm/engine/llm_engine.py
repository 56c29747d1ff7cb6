"""The engine: tokenizer, worker processes, request intake and stats. The step loop is in
``step_loop.py``, the offline calls built on it (generate, chat, stream) in ``offline.py``."""
import atexit
import json
import os
import socket
import traceback
import uuid

from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.offline import OfflineCalls
from nanovllm.engine.requests import Request, prompt_token_ids
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.step_loop import LaunchedStep, StepLoop
from nanovllm.engine.workers import WorkerGroup
from nanovllm.sampling_params import SamplingParams

# generation_config.json keys that set a default SamplingParams field, as vLLM reads them
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LLMEngine(StepLoop, OfflineCalls):
    def __init__(self, model: str, **kwargs):
        accepted = [name for name in Config.field_names() if name != "model"]
        for key in kwargs:
            if key not in accepted:
                raise TypeError(f"LLM() got an unexpected keyword argument {key!r}; accepted: {', '.join(accepted)}")
        config = Config(model, **kwargs)
        self.config = config
        self._check_parallel(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)  # before any process starts
        self._exited = False
        self._failure: str | None = None
        self.model_runner = None
        self.workers = None
        port = _free_port()
        shm_name = f"nanovllm-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        if config.tensor_parallel_size > 1:
            self.workers = WorkerGroup(config, port, shm_name)
        try:
            if self.workers:
                self.model_runner = ModelRunner(config, 0, port, shm_name, self.workers.events, self.workers.failure)
            else:
                self.model_runner = ModelRunner(config, 0, port, shm_name, [])
        except BaseException as e:  # the runner has released what it held
            failure = self.workers.wait_failure(2.0) if self.workers else None
            if self.workers:
                self.workers.close(timeout=1.0)
            if failure:
                raise RuntimeError(f"{failure} while the engine was starting") from e
            raise
        atexit.register(self.exit)
        self.vocab_size = config.hf_config.vocab_size
        self.generation_config = self._read_generation_config(config.model)
        eos = {
            self.tokenizer.eos_token_id,
            *self._as_list(getattr(config.hf_config, "eos_token_id", None)),
            *self._as_list(self.generation_config.get("eos_token_id")),
        }
        self.eos_token_ids = sorted(e for e in eos if e is not None)
        self.num_kvcache_blocks = self.model_runner.num_kvcache_blocks
        self.scheduler = Scheduler(
            num_blocks=self.num_kvcache_blocks,
            block_size=config.kvcache_block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_id=self.eos_token_ids,
        )
        self._requests: dict[int, Request] = {}  # request id -> request, until all its completions end
        self._collected: set[int] = set()  # sequence ids whose results a generate/stream call in flight takes
        self._unclaimed: list[tuple[int, list[int]]] = []  # finished during such a call, for step()'s caller
        self._launched: LaunchedStep | None = None  # the step whose tokens the host has not taken yet
        self.num_prompt_tokens = 0  # computed in prefill (prefix-cache hits not counted)
        self.num_generation_tokens = 0
        self.last_throughput = {"prefill": 0.0, "decode": 0.0}  # tokens/s of the last generate/chat/stream

    @staticmethod
    def _check_parallel(config: Config) -> None:
        """Reject a tensor_parallel_size the device or the model cannot split over, before any
        process starts."""
        tp = config.tensor_parallel_size
        if config.resolved_device() == "cuda":
            import torch

            if tp > torch.cuda.device_count():
                raise ValueError(
                    f"Config.tensor_parallel_size={tp} but only {torch.cuda.device_count()} GPU(s) are visible"
                )
        hf = config.hf_config
        for name in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
            value = getattr(hf, name)
            if value % tp:
                raise ValueError(
                    f"Config.tensor_parallel_size={tp} must divide the model's {name} ({value})"
                )

    @staticmethod
    def _read_generation_config(model: str) -> dict:
        path = os.path.join(model, "generation_config.json")
        if not os.path.isfile(path):
            return {}
        with open(path) as f:
            return json.load(f)

    @staticmethod
    def _as_list(x) -> list:
        return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]

    def exit(self) -> None:
        """Release worker processes, shared memory and the process group (idempotent)."""
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        healthy = self._failure is None and not (self.workers and self.workers.failure())
        if self.workers:
            self.workers.closing = True
        if self.model_runner is not None:
            try:
                if not healthy:
                    raise RuntimeError("a rank is gone")
                self.model_runner.call("exit")  # every rank leaves its loop and the group
            except Exception:
                self.model_runner.release(failed=True)
            self.model_runner = None
        if self.workers:
            self.workers.close(timeout=30.0 if healthy else 1.0)

    def _call(self, method_name: str, *args):
        """Run a method on every rank (see ``_guarded``)."""
        return self._guarded(lambda: self.model_runner.call(method_name, *args))

    def _guarded(self, fn):
        """``fn()``, where a dead worker turns into a clear error, after which the engine is
        released and refuses further work."""
        if self._failure:
            raise RuntimeError(self._failure)
        if self.workers and (failure := self.workers.failure()):
            self._fail(failure, None)
        try:
            return fn()
        except Exception as e:
            failure = self.workers.wait_failure(2.0) if self.workers else None
            if failure:
                traceback.clear_frames(e.__traceback__)  # their tensors can then be freed
                self._fail(failure, e)
            raise

    def _fail(self, failure: str, cause: BaseException | None):
        self._failure = f"{failure}; the engine has stopped, create a new LLM to continue"
        self.exit()
        raise RuntimeError(self._failure) from cause

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.exit()

    # ---- requests ----------------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """What the model folder's ``generation_config.json`` recommends (temperature, top_p, top_k,
        min_p, repetition_penalty, and max_new_tokens as max_tokens), over ``SamplingParams()``'s
        defaults; used when a call passes no sampling params."""
        config = self.generation_config
        return SamplingParams(**{field: config[key] for key, field in GENERATION_CONFIG_FIELDS.items()
                                 if config.get(key) is not None})

    def _make_request(self, prompt, sampling_params: SamplingParams, where: str, stream: bool = False) -> Request:
        """Check one request and build its sequences; ``where`` names it in error messages.
        ``stream``: its completions keep their text token by token."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"{where}: sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        token_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size, where)
        for t in sampling_params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"{where}: stop_token_ids holds {t}, outside the vocabulary [0, {self.vocab_size})")
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"{where}: the prompt has {len(token_ids)} tokens; max_model_len={max_len} leaves room for "
                f"prompts of at most {max_len - 1} tokens"
            )
        block_size = self.config.kvcache_block_size
        longest = min(len(token_ids) + sampling_params.max_tokens, max_len)
        blocks = -(-longest // block_size)
        if blocks > self.num_kvcache_blocks:
            raise ValueError(
                f"{where}: prompt ({len(token_ids)} tokens) plus max_tokens ({sampling_params.max_tokens}) needs up "
                f"to {blocks} KV-cache blocks of {block_size} tokens, but the whole cache holds "
                f"{self.num_kvcache_blocks}"
            )
        tokenizer = self.tokenizer if stream or sampling_params.stop else None
        return Request(token_ids, sampling_params, block_size, self.eos_token_ids, tokenizer)

    def _queue(self, request: Request) -> None:
        self._requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def add_request(self, prompt, sampling_params: SamplingParams) -> int:
        """Queue one request; returns its request id, which is the sequence id ``step`` reports
        (with ``n > 1``, completion ``i`` is reported as ``request_id + i``)."""
        request = self._make_request(prompt, sampling_params, "prompt")
        self._queue(request)
        return request.request_id

    def abort_request(self, request_id: int) -> bool:
        """End a waiting or running request and free its blocks; its completions are not reported.
        Returns False when no such request is queued (unknown, or already finished)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            self.scheduler.finish(seq, "abort")
        return True

    def get_stats(self) -> dict:
        """Counts now (sequences: a request with ``n`` completions counts ``n``), cumulative
        token counts, and the last generate/chat/stream call's prefill and decode tokens/s."""
        bm = self.scheduler.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": len(bm.used_block_ids) / len(bm.blocks),
            "prefix_cache_hit_rate": bm.num_hit_tokens / bm.num_queried_tokens if bm.num_queried_tokens else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "prefill_throughput": self.last_throughput["prefill"],
            "decode_throughput": self.last_throughput["decode"],
        }
