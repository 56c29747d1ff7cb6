"""The engine core: the scheduler, the step pipeline and the executor, on token ids only.

It knows no text: requests come in as token ids and sampling params, and each ``step()`` reports
what the requests gained and which of their sequences finished, as plain data (the tokenizer's
vocabulary serves only structured outputs' grammars). With async scheduling the host schedules and
launches step N+1 while the device computes step N, and takes step N's tokens after that launch.
"""

from dataclasses import dataclass
from random import Random

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, request_sequences
from nanovllm.engine.step import build_step
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.profiling import phase

ASLEEP = "the engine is asleep; call wake_up()"


@dataclass
class SeqOutput:
    """What one sequence gained in a step: its new token ids (and their log-probabilities, each
    ``(logprob, {token_id: logprob})``, when it asked for them); once finished, why."""

    seq_id: int
    request_id: int
    new_token_ids: list[int]
    new_logprobs: list[tuple[float, dict[int, float]]] | None = None
    # the request's prompt log-probabilities (``prompt_logprobs``), once, with completion 0's first report
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at first admission


@dataclass
class LaunchedStep:
    """A step in flight: its output on the way to the host, its sequences, and where each one's
    sampled token goes (``Scheduler.advance``). ``needs_sync``: resolve it before the next schedule."""

    output: object
    seqs: list[Sequence]
    positions: list[int]
    needs_sync: bool = False


def take_prompt_logprobs(seq: Sequence, first: int, entries: list) -> None:
    """Prompt tokens ``first``, ``first + 1``, ... scored by a step: those not scored before (a
    preempted sequence computes its prompt again) join ``seq.prompt_logprobs``."""
    if seq.prompt_logprobs is not None:
        seq.prompt_logprobs += entries[len(seq.prompt_logprobs) - first :]


class EngineCore:
    def __init__(self, config, eos_token_ids: list[int], executor, tokenizer=None):
        """``executor`` runs steps on every rank (``engine.executor.Executor``: ``run(step)``,
        ``result(output)``, ``exit()``, ``num_kvcache_blocks``); the core itself needs no torch.
        ``tokenizer``: the front end's, for structured outputs (None: loaded from the model folder
        when a request first needs it)."""
        self.config = config
        self.tokenizer = tokenizer
        self.grammars = None  # structured_outputs.grammar.GrammarCompiler, made by the first request that needs it
        self.executor = executor
        self.num_kvcache_blocks = self.executor.num_kvcache_blocks
        self.scheduler = Scheduler(
            num_blocks=self.num_kvcache_blocks,
            block_size=config.kvcache_block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_id=eos_token_ids,
        )
        self.eos_token_ids = eos_token_ids
        self.rng = Random()  # draw seeds of unseeded requests
        self.requests: dict[
            int, list[Sequence]
        ] = {}  # request id -> its sequences, until all finish
        self.reporting: set[int] = set()  # sequences that report their tokens every step
        self._launched: LaunchedStep | None = None
        self.num_prompt_tokens = 0  # computed in prefill (prefix-cache hits not counted)
        self.sleep_level = 0  # 0: awake; 1 or 2: asleep at that level (``sleep``)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        report_every_step: bool = False,
    ) -> None:
        """Queue a request's ``n`` completions as sequences ``request_id + i`` (see
        ``request_sequences``). ``report_every_step``: its sequences report new tokens every step
        (streams, stop strings, logprobs), not only when they finish."""
        seqs = request_sequences(
            request_id,
            prompt_token_ids,
            sampling_params,
            self.config.kvcache_block_size,
            self.eos_token_ids,
        )
        if sampling_params.structured_outputs is not None:
            for seq in seqs:  # one matcher per completion
                seq.grammar = self._grammar_compiler().matcher(sampling_params.structured_outputs)
        self.requests[request_id] = seqs
        for seq in seqs:
            if report_every_step:
                self.reporting.add(seq.seq_id)
            self.scheduler.add(seq)

    def _grammar_compiler(self):
        if self.grammars is None:
            from nanovllm.features.structured_outputs.grammar import (
                GrammarCompiler,
            )  # xgrammar: only when used
            from nanovllm.utils.model_folder import load_tokenizer

            tokenizer = (
                self.tokenizer if self.tokenizer is not None else load_tokenizer(self.config.model)
            )
            self.grammars = GrammarCompiler(
                tokenizer, self.config.hf_config.vocab_size, self.eos_token_ids
            )
        return self.grammars

    def abort_request(self, request_id: int) -> bool:
        """End a request's sequences and free their blocks; they report nothing more. False when
        no such request is queued."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            self.scheduler.finish(seq, "abort")
            self.reporting.discard(seq.seq_id)
        return True

    def finish_sequence(self, seq_id: int, request_id: int) -> None:
        """End a sequence the front end has found finished (a stop string in its text)."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return
        seq = seqs[seq_id - request_id]
        self.scheduler.finish(seq, "stop")
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self.reporting.discard(seq.seq_id)
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[seq.request_id]

    # ---- the step pipeline -------------------------------------------------------------------

    def step(self) -> tuple[list[SeqOutput], int]:
        """Schedule and launch a step, then resolve the one before it (``async_scheduling``: the
        host learns a step's tokens while the device computes the next), or this one (without).
        Returns what sequences gained, and the prefill tokens this step computes (> 0) or minus
        the sequences it decodes (< 0; 0 when none was launched)."""
        if self.sleep_level:
            raise RuntimeError(ASLEEP)
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
                raise RuntimeError(
                    "no queued request can be scheduled (the KV cache cannot hold the next one)"
                )
            return outputs, 0
        try:
            output = self.executor.run(step)
        except BaseException:
            self.scheduler.unschedule(seqs)  # nothing of the step was computed
            if self._launched is not None:  # its tokens are needed before these are scheduled again
                self._launched.needs_sync = True
            raise
        num_tokens = sum(step.num_new) if is_prefill else -len(seqs)
        if is_prefill:
            self.num_prompt_tokens += num_tokens
        # penalties count the sampled tokens on the host, and grammar matchers take them there: the
        # next step's sampling needs their values
        needs_sync = (
            step.sampling.penalty_tokens is not None or step.sampling.token_bitmask is not None
        )
        launched = LaunchedStep(output, seqs, self.scheduler.advance(seqs), needs_sync)
        if self._launched is not None:
            outputs += self._resolve()
        self._launched = launched
        if not self.config.async_scheduling:
            outputs += self._resolve()
        return outputs, num_tokens

    def _resolve(self) -> list[SeqOutput]:
        """Take the launched step's tokens into its sequences; report what they gained."""
        launched, self._launched = self._launched, None
        with phase("wait"):
            token_ids, logprobs, prompt_logprobs = self.executor.result(launched.output)
        with phase("update"):
            for row, (first, entries) in (prompt_logprobs or {}).items():
                take_prompt_logprobs(launched.seqs[row], first, entries)
            finished = self.scheduler.resolve(launched.seqs, launched.positions, token_ids)
            outputs = []
            if self.reporting:
                for i, seq in enumerate(launched.seqs):
                    if (
                        seq.seq_id in self.reporting
                        and 0 <= launched.positions[i] < seq.num_known_tokens
                    ):
                        outputs.append(self._report(seq, logprobs[i] if logprobs else None))
            reported = {o.seq_id for o in outputs}
            outputs += [self._report(seq, None) for seq in finished if seq.seq_id not in reported]
            for seq in finished:
                self._forget(seq)
        return outputs

    def _report(self, seq: Sequence, logprobs) -> SeqOutput:
        start = seq.num_prompt_tokens + seq.num_reported
        new = seq.token_ids[start : seq.num_known_tokens]
        seq.num_reported += len(new)
        out = SeqOutput(
            seq.seq_id,
            seq.request_id,
            new,
            None if logprobs is None else [logprobs],
            num_cached_tokens=max(seq.num_prefix_hit_tokens, 0),
        )
        if seq.prompt_logprobs is not None and not seq.scores_prompt:
            out.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None  # reported once
        if seq.is_finished:
            out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
        return out

    def _owes_results(self) -> bool:
        """Whether the launched step still has tokens to deliver (not just ones past an end)."""
        return self._launched is not None and not all(
            seq.is_finished for seq in self._launched.seqs
        )

    def settle(self) -> list[SeqOutput]:
        """Resolve a launched step that only computed tokens past its sequences' ends, so that a
        call ends with nothing in flight (what it reports, if anything, is returned)."""
        if self._launched is not None and not self._owes_results():
            return self._resolve()
        return []

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and not self._owes_results()

    # ---- weights and the prefix cache --------------------------------------------------------

    def update_weights(self, weights: list) -> None:
        """Copy ``(checkpoint name, tensor)`` pairs into the model on every rank (the executor
        checks them all before any is written), then drop the prefix cache: its KV came from the
        old weights. Only between requests: nothing queued, running or in flight."""
        self._check_idle("update_weights")
        if self.sleep_level:
            raise RuntimeError(ASLEEP)
        self.executor.update_weights(weights)
        self.reset_prefix_cache()

    def _check_idle(self, what: str) -> None:
        if not self.scheduler.is_finished() or self._launched is not None:
            raise RuntimeError(
                f"{what} needs an idle engine core: a request is queued, running or in flight"
            )

    # ---- sleep mode --------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Free the KV cache, the CUDA graphs and the weights on every rank (level 1: weights kept
        on the host; 2: dropped), and drop the prefix cache, whose KV is gone. Only while idle and
        awake."""
        self._check_idle("sleep")
        if self.sleep_level:
            raise RuntimeError(
                f"the engine is already asleep (level {self.sleep_level}); call wake_up() first"
            )
        self.executor.sleep(level)
        self.sleep_level = level
        self.reset_prefix_cache()

    def wake_up(self) -> None:
        """Reallocate what ``sleep`` freed, the KV cache with as many blocks as before (a no-op
        while awake)."""
        if self.sleep_level:
            self.executor.wake_up()
            self.sleep_level = 0

    def reset_prefix_cache(self) -> bool:
        """No block cached so far is a prefix-cache hit from now on (``BlockManager.reset_prefix_cache``)."""
        self.scheduler.block_manager.reset_prefix_cache()
        return True

    def stats(self) -> dict:
        bm = self.scheduler.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": len(bm.used_block_ids) / len(bm.blocks),
            "prefix_cache_hit_rate": bm.num_hit_tokens / bm.num_queried_tokens
            if bm.num_queried_tokens
            else 0.0,
            "prefix_cache_queries": bm.num_queried_tokens,  # prompt tokens looked up, and those found
            "prefix_cache_hits": bm.num_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.scheduler.num_generated_tokens,
        }

    @property
    def failure_message(self) -> str | None:
        """Why the engine has stopped (a rank died), if it has."""
        return self.executor.failure_message

    def exit(self) -> None:
        self.executor.exit()
