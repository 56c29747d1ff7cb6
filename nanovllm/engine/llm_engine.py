"""The engine: tokenizer, request intake and checks, the generate loop, worker processes."""
import atexit
import os
import socket
import traceback
import uuid
from time import perf_counter

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.workers import WorkerGroup
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LLMEngine:
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
        eos = {self.tokenizer.eos_token_id, *self._as_list(getattr(config.hf_config, "eos_token_id", None))}
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
        self._unclaimed: list[tuple[int, list[int]]] = []  # finished during generate(), not its own

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
        """Run a method on every rank; a dead worker turns into a clear error, after which the
        engine is released and refuses further work."""
        if self._failure:
            raise RuntimeError(self._failure)
        if self.workers and (failure := self.workers.failure()):
            self._fail(failure, None)
        try:
            return self.model_runner.call(method_name, *args)
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

    def _make_sequence(self, prompt: Prompt, sampling_params: SamplingParams, where: str) -> Sequence:
        """Check one request and build its Sequence; ``where`` names it in error messages."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"{where}: sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            for i, t in enumerate(token_ids):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise TypeError(f"{where}: token {i} must be an int, got {t!r} ({type(t).__name__})")
        else:
            raise TypeError(f"{where}: a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        # also for text: the tokenizer may know more tokens than the model (e.g. a small random model)
        for i, t in enumerate(token_ids):
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"{where}: token {i} is {t}, outside the vocabulary [0, {self.vocab_size})")
        max_len = self.config.max_model_len
        if not token_ids:
            raise ValueError(f"{where}: the prompt is empty")
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
        return Sequence(token_ids, sampling_params, block_size)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams) -> int:
        """Queue one request; returns its sequence id (as reported by ``step``)."""
        seq = self._make_sequence(prompt, sampling_params, "prompt")
        self.scheduler.add(seq)
        return seq.seq_id

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """Run one scheduled step. Returns the ``(seq_id, completion_token_ids)`` of the sequences
        that finished, and the prefill tokens computed (> 0) or minus the sequences decoded (< 0)."""
        seqs, is_prefill = self.scheduler.schedule()
        outputs, self._unclaimed = self._unclaimed, []
        if not seqs:
            if not self.scheduler.is_finished():
                raise RuntimeError("no queued request can be scheduled (the KV cache cannot hold the next one)")
            return outputs, 0
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        token_ids = self._call("run", seqs, is_prefill)
        finished = self.scheduler.postprocess(seqs, token_ids)
        outputs += [(seq.seq_id, seq.completion_token_ids) for seq in finished]
        return outputs, num_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and not self._unclaimed

    # ---- batch generation --------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict]:
        """Generate completions for all prompts; returns one dict per prompt, in input order.

        Every prompt is checked before any is queued: on a bad one nothing is queued.
        """
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of str or a list of token-id lists, got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(sampling_params)} entries but there are {len(prompts)} prompts"
                )
        else:
            sampling_params = [sampling_params] * len(prompts)
        seqs = [self._make_sequence(p, sp, f"prompts[{i}]") for i, (p, sp) in enumerate(zip(prompts, sampling_params))]
        for seq in seqs:
            self.scheduler.add(seq)
        ours = {seq.seq_id for seq in seqs}
        pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        remaining = len(seqs)
        while remaining:
            t = perf_counter()
            outputs, num_tokens = self.step()
            dt = perf_counter() - t
            if num_tokens > 0:
                prefill_tps = num_tokens / dt
            elif num_tokens < 0:
                decode_tps = -num_tokens / dt
            pbar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s")
            for seq_id, token_ids in outputs:
                if seq_id in ours:
                    remaining -= 1
                    pbar.update(1)
                else:
                    self._unclaimed.append((seq_id, token_ids))
        pbar.close()
        return [self._output(seq) for seq in seqs]

    def _output(self, seq: Sequence) -> dict:
        token_ids = seq.completion_token_ids
        stopped = not seq.ignore_eos and token_ids[-1] in self.scheduler.eos_token_ids
        return {
            "text": self.tokenizer.decode(token_ids, skip_special_tokens=True),
            "token_ids": token_ids,
            "prompt_token_ids": seq.prompt_token_ids,
            "finish_reason": "stop" if stopped else "length",
            "num_cached_tokens": seq.num_prefix_hit_tokens,
        }
