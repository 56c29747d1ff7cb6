"""The engine core: scheduler and executor on token ids; async scheduling (docs/engine.md)."""

from dataclasses import dataclass
from random import Random

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, request_sequences
from nanovllm.engine.step import build_step
from nanovllm.models.config import kv_layers
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.profiling import phase


@dataclass
class SeqOutput:
    seq_id: int
    request_id: int
    new_token_ids: list[int]
    new_logprobs: list[tuple[float, dict[int, float]]] | None = None  # (logprob, top ones)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once, with the first report
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at first admission


@dataclass
class LaunchedStep:
    output: object  # a step in flight
    seqs: list[Sequence]
    positions: list[int]  # where each sampled token goes (``Scheduler.advance``)
    needs_sync: bool = False  # resolve it before the next schedule


def is_plain(sp: SamplingParams) -> bool:
    extras = (sp.logprobs, sp.prompt_logprobs, sp.structured_outputs)
    return not (sp.min_tokens or sp.has_penalties or sp.has_filters) and extras == (None,) * 3


class EngineCore:
    def __init__(self, config, eos_token_ids: list[int], executor, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer
        self.executor = executor
        self.num_kvcache_blocks = executor.num_kvcache_blocks
        self.scheduler = Scheduler(config, self.num_kvcache_blocks, eos_token_ids)
        self.eos_token_ids = eos_token_ids
        self.rng = Random(config.seed)  # draws seeds of unseeded requests
        self.scheduler.block_manager.caching = config.enable_prefix_caching
        if kv_layers(config.hf_config) < config.hf_config.num_hidden_layers:
            from nanovllm.engine.state_slots import StateSlotBlockManager  # hybrid models

            slots = (self.num_kvcache_blocks, config.kvcache_block_size, config.max_num_seqs + 1)
            self.scheduler.block_manager = StateSlotBlockManager(*slots)
        self.requests: dict[int, list[Sequence]] = {}  # request id -> its sequences
        self.reporting: set[int] = set()  # sequences that report their tokens every step
        self.shared: dict = {}  # what request processors keep per engine (a grammar compiler)
        self._launched: LaunchedStep | None = None
        self.num_prompt_tokens = 0  # computed in prefill (prefix-cache hits not counted)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request_id, token_ids, sp, report_every_step=False, lora=None) -> None:
        seqs = request_sequences(request_id, token_ids, sp, self.config.kvcache_block_size)
        if not is_plain(sp) or lora is not None:  # lora: a LoRARequest (nanovllm/lora/)
            from nanovllm.features.attach import attach_processors

            attach_processors(seqs, self.eos_token_ids, self, lora)
        self.requests[request_id] = seqs
        for seq in seqs:
            if report_every_step:
                self.reporting.add(seq.seq_id)
            self.scheduler.add(seq)

    def abort_request(self, request_id: int) -> bool:
        """End a request's sequences; False when none is queued."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            self.scheduler.finish(seq, "abort")
            self.reporting.discard(seq.seq_id)
            seq.processors = []
        return True

    def finish_sequence(self, seq_id: int, request_id: int) -> None:
        """End a sequence the front end found finished (a stop string)."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return
        seq = seqs[seq_id - request_id]
        self.scheduler.finish(seq, "stop")
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self.reporting.discard(seq.seq_id)
        seq.processors = []
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[seq.request_id]

    # ---- the step pipeline -------------------------------------------------------------------

    def step(self) -> tuple[list[SeqOutput], int]:
        """Launch a step, then resolve the one before it (async) or this one: the outputs, and the
        prefill tokens (> 0) or minus the decoded sequences (< 0)."""
        outputs = []
        if self._launched is not None and self._launched.needs_sync:
            outputs += self._resolve()
        with phase("schedule"):
            seqs, is_prefill = self.scheduler.schedule()
            step = build_step(seqs, is_prefill, self.rng) if seqs else None
        if step is None:
            if self._launched is not None:  # what it finishes may make room
                return outputs + self._resolve(), 0
            if not self.scheduler.is_finished():
                raise RuntimeError("no queued request fits: the KV cache cannot hold the next one")
            return outputs, 0
        try:
            output = self.executor.run(step)
        except BaseException:
            self.scheduler.unschedule(seqs)  # nothing of the step was computed
            if self._launched is not None:  # its tokens are needed before these are scheduled
                self._launched.needs_sync = True
            raise
        num_tokens = sum(step.num_new) if is_prefill else -len(seqs)
        if is_prefill:
            self.num_prompt_tokens += num_tokens
        sync = step.sampling.extra is not None and step.sampling.extra.sync
        launched = LaunchedStep(output, seqs, self.scheduler.advance(seqs), sync)
        if self._launched is not None:
            outputs += self._resolve()
        self._launched = launched
        if not self.config.async_scheduling:
            outputs += self._resolve()
        return outputs, num_tokens

    def _resolve(self) -> list[SeqOutput]:
        launched, self._launched = self._launched, None
        seqs, positions = launched.seqs, launched.positions
        with phase("wait"):
            token_ids, extras = self.executor.result(launched.output)
        with phase("update"):
            for seq, extra in zip(seqs, extras or ()):
                for p in seq.processors if extra is not None else ():
                    p.take(seq, extra)
            finished = self.scheduler.resolve(seqs, positions, token_ids)
            outputs = []
            if self.reporting:
                for i, seq in enumerate(seqs):
                    if seq.seq_id in self.reporting and 0 <= positions[i] < seq.num_known_tokens:
                        outputs.append(self._report(seq, extras[i] if extras else None))
            reported = {o.seq_id for o in outputs}
            outputs += [self._report(seq, None) for seq in finished if seq.seq_id not in reported]
            for seq in finished:
                self._forget(seq)
        return outputs

    def _report(self, seq: Sequence, extra: dict | None) -> SeqOutput:
        start = seq.num_prompt_tokens + seq.num_reported
        new = seq.token_ids[start : seq.num_known_tokens]
        seq.num_reported += len(new)
        hits = max(seq.num_prefix_hit_tokens, 0)
        out = SeqOutput(seq.seq_id, seq.request_id, new, num_cached_tokens=hits)
        for p in seq.processors:
            p.report(seq, out, extra)
        if seq.is_finished:
            out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
        return out

    def _owes_results(self) -> bool:  # the launched step has tokens to deliver
        return self._launched is not None and not all(s.is_finished for s in self._launched.seqs)

    def settle(self) -> list[SeqOutput]:
        if self._launched is not None and not self._owes_results():
            return self._resolve()
        return []

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and not self._owes_results()

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        return self.executor.collective_rpc(method, args, kwargs)

    def reset_prefix_cache(self) -> bool:
        self.scheduler.block_manager.reset_prefix_cache()
        return True

    def stats(self) -> dict:
        bm = self.scheduler.block_manager
        queried = bm.num_queried_tokens  # prompt tokens looked up, and those found
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": len(bm.used_block_ids) / len(bm.blocks),
            "prefix_cache_hit_rate": bm.num_hit_tokens / queried if queried else 0.0,
            "prefix_cache_queries": queried,
            "prefix_cache_hits": bm.num_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.scheduler.num_generated_tokens,
        }

    @property
    def failure_message(self) -> str | None:  # why the engine has stopped (a rank died)
        return self.executor.failure_message

    def exit(self) -> None:
        self.executor.exit()
