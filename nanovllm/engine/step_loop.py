"""The step loop: schedule a step, launch it on every rank, and resolve a step's sampled tokens
(stop conditions, stop strings, finished requests). With async scheduling the host schedules and
prepares step N+1 while the device computes step N, and resolves step N after launching N+1."""
from dataclasses import dataclass

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_output import StepOutput
from nanovllm.utils.interrupts import deferred_interrupt


@dataclass
class LaunchedStep:
    """A step in flight: its output, its sequences, and where each one's sampled token goes
    (``Scheduler.advance``). ``needs_sync``: resolve it before scheduling the next step."""

    output: StepOutput
    seqs: list[Sequence]
    positions: list[int]
    needs_sync: bool = False


class StepLoop:
    """Mixed into ``LLMEngine``: uses its ``config``, ``scheduler``, ``_call``, ``_guarded``,
    request table and counters."""

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """Run one scheduled step. Returns the ``(seq_id, completion_token_ids)`` of the sequences
        whose results became complete (with async scheduling, by the tokens of the step before),
        and the prefill tokens this step computes (> 0) or minus the sequences it decodes (< 0; 0
        when none was launched). Ctrl-C during a step takes effect when the step is complete."""
        result = None
        try:
            with deferred_interrupt():
                result = self._step()
        except KeyboardInterrupt:
            if result is not None:  # the step completed: what finished in it is not lost
                self._unclaimed += [o for o in result[0] if o[0] not in self._collected]
            raise
        return result

    def _step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """Schedule and launch a step, then resolve the one before it (``async_scheduling``: the
        host learns a step's tokens while the device computes the next), or this one (without)."""
        outputs, self._unclaimed = self._unclaimed, []
        if self._launched is not None and self._launched.needs_sync:
            outputs += self._resolve()
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            if self._launched is not None:  # what it finishes may make room
                return outputs + self._resolve(), 0
            if not self.scheduler.is_finished():
                raise RuntimeError("no queued request can be scheduled (the KV cache cannot hold the next one)")
            return outputs, 0
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        rows = [seq.pending_row if seq.num_pending else -1 for seq in seqs]
        try:
            output = self._call("run", seqs, is_prefill, rows if max(rows) >= 0 else None)
        except BaseException:
            self.scheduler.unschedule(seqs)  # nothing of the step was computed
            if self._launched is not None:  # its tokens are needed before these are scheduled again
                self._launched.needs_sync = True
            raise
        if is_prefill:
            self.num_prompt_tokens += num_tokens
        launched = LaunchedStep(output, seqs, self.scheduler.advance(seqs))
        if self._launched is not None:
            outputs += self._resolve()
        self._launched = launched
        # penalties count the sampled tokens on the host: the next step's sampling needs their values
        launched.needs_sync = any(seq.sampling_params.has_penalties for seq in seqs)
        if not self.config.async_scheduling:
            outputs += self._resolve()
        return outputs, num_tokens

    def _resolve(self) -> list[tuple[int, list[int]]]:
        """Take the launched step's tokens: stop conditions, stop strings, finished requests."""
        launched, self._launched = self._launched, None
        token_ids, logprobs = self._guarded(launched.output.result)
        seqs = launched.seqs
        known = sum(seq.num_known_tokens for seq in seqs)
        finished = self.scheduler.resolve(seqs, launched.positions, token_ids, logprobs)
        self.num_generation_tokens += sum(seq.num_known_tokens for seq in seqs) - known
        self._update_text(seqs, finished)
        outputs = [(seq.seq_id, seq.completion_token_ids) for seq in finished if seq.request_id in self._requests]
        for seq in finished:
            request = self._requests.get(seq.request_id)
            if request is not None and request.is_finished:
                del self._requests[seq.request_id]
        return outputs

    def _update_text(self, seqs: list[Sequence], finished: list[Sequence]) -> None:
        """Feed newly known tokens to the detokenizers (streams, stop strings); a sequence a stop
        string ends joins ``finished``. One that ended by length meanwhile ends by its stop string."""
        for seq in seqs:
            detokenizer = seq.detokenizer
            if detokenizer is None or seq.finish_reason == "abort":
                continue
            new = seq.token_ids[seq.num_prompt_tokens + len(detokenizer.token_ids) : seq.num_known_tokens]
            if not new:
                continue
            num_known = seq.num_known_tokens - seq.num_prompt_tokens
            check = seq.finish_reason in (None, "length") and num_known > seq.min_tokens
            stop = detokenizer.add_tokens(new, check, hide_last=seq.num_text_tokens < num_known)
            if stop is None:
                continue
            self.scheduler.stop(seq, "stop", stop)
            if seq not in finished:
                finished.append(seq)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and not self._unclaimed and not self._owes_results()

    def _owes_results(self) -> bool:
        """Whether the launched step still has tokens to deliver (not just ones past an end)."""
        return self._launched is not None and not all(seq.is_complete for seq in self._launched.seqs)

    def _settle(self) -> None:
        """Resolve a launched step that only computed tokens past its sequences' ends, so that a
        call ends with nothing in flight."""
        if self._launched is not None and not self._owes_results():
            self._resolve()
