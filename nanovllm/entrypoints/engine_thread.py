"""``AsyncLLM``'s engine thread: every engine call runs here, between steps (docs/async.md)."""

import queue
import threading

from nanovllm.entrypoints import step_loop
from nanovllm.entrypoints.output_kinds import Live, aborted_output, request_output
from nanovllm.sampling_params import RequestOutputKind

PAUSE_MODES = ("abort", "wait", "keep")
STOP = object()  # the command that ends the thread


class RetryableRequestError(RuntimeError):
    """A request refused while generation is paused (mode "abort" or "wait"); retry later."""


def post_to(loop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's loop has closed: nobody waits for it
        pass


def settle_future(future, result=None, error: BaseException | None = None) -> None:
    if future.done():  # cancelled or timed out meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class EngineThread:
    """Owns ``llm``: commands come through a queue; outputs go back with call_soon_threadsafe."""

    def __init__(self, llm):
        self.llm = llm
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()  # a command is queued only while the thread takes them
        self.dead: BaseException | None = None
        self.live: dict[str, Live] = {}
        self.paused: str | None = None  # None, or the pause mode
        self.parked: tuple[list, list] | None = None  # the scheduler's queues while kept
        self.drain_waiters: list = []  # (loop, future) of pause(mode="wait") calls
        self.thread = threading.Thread(target=self._main, name="nanovllm-engine", daemon=True)
        self.thread.start()

    # ---- the other threads' side ---------------------------------------------------------------

    def post(self, fn, *args, reply=None) -> None:
        """Run ``fn(*args)`` on the engine thread; ``reply``: (loop, future) for its result."""
        with self.lock:
            if self.dead is not None:
                raise RuntimeError(str(self.dead)) from self.dead
            self.commands.put((fn, args, reply))

    def stop(self, timeout: float = 60.0) -> None:
        with self.lock:
            if self.dead is None:
                self.commands.put(STOP)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    # ---- the loop ----------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            while self._serve_commands():
                if self._busy():
                    self._step()
                self._check_drained()
        except BaseException as e:  # a bug or a dead engine: every waiter hears of it
            self._die(RuntimeError(f"the engine thread stopped: {type(e).__name__}: {e}"), e)
            return
        self._die(RuntimeError("this AsyncLLM has been shut down; create a new one"))

    def _busy(self) -> bool:
        return self.paused != "keep" and not self.llm.core.is_finished()

    def _serve_commands(self) -> bool:
        """Run the queued commands, waiting for one when there is nothing to step."""
        block = not self._busy()
        while True:
            try:
                command = self.commands.get(block=block)
            except queue.Empty:
                return True
            if command is STOP:
                return False
            fn, args, reply = command
            try:
                result, error = fn(*args), None
            except Exception as e:
                result, error = None, e
            if reply is not None:
                post_to(reply[0], settle_future, reply[1], result, error)
            block = False

    def _die(self, error: RuntimeError, cause: BaseException | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        with self.lock:
            self.dead = error
            pending = []
            while True:
                try:
                    pending.append(self.commands.get_nowait())
                except queue.Empty:
                    break
        for command in pending:
            if command is not STOP and command[2] is not None:
                post_to(command[2][0], settle_future, command[2][1], None, error)
        for live in self.live.values():
            post_to(live.loop, live.stream.put, error)
        self.live.clear()
        self._release_drain_waiters(error)
        try:
            self.llm.exit()
        except Exception:  # the engine's own failure is already the error reported
            pass

    def _step(self) -> None:
        llm = self.llm
        try:
            llm._step()
        except Exception as e:
            for key in [k for k, live in self.live.items() if live.rid is not None]:
                self._drop(self.live.pop(key), e)
            if llm.core.failure_message:
                raise
            return
        self._deliver()
        if llm.core.is_finished():
            llm._process(llm.core.settle())

    # ---- requests ----------------------------------------------------------------------------

    def add(self, live: Live, prompt, sampling_params, lora_request=None) -> None:
        try:
            if self.paused in ("abort", "wait"):
                raise RetryableRequestError(
                    f"request {live.key!r}: generation is paused (mode={self.paused!r}); new "
                    "requests are refused until resume_generation()"
                )
            self.llm._check_running()
            if sampling_params is None:
                sampling_params = self.llm.get_default_sampling_params()
            checked = self.llm.inputs.check(prompt, sampling_params, f"request {live.key!r}")
            checked = step_loop.checked(self.llm, checked, lora_request)
        except Exception as e:
            post_to(live.loop, live.stream.put, e)
            return
        live.n = checked[1].n
        self.live[live.key] = live
        if self.paused == "keep":
            live.queued = checked
        else:
            self._queue(live, checked)

    def _queue(self, live: Live, checked: tuple) -> None:
        streamed = live.kind != RequestOutputKind.FINAL_ONLY
        live.rid = self.llm._queue(*checked, stream=streamed)
        self.llm._owned.add(live.rid)
        live.queued = None

    def abort(self, keys: list[str]) -> None:
        for key in keys:
            live = self.live.pop(key, None)
            if live is not None:
                self._drop(live)

    def _drop(self, live: Live, error: BaseException | None = None) -> None:
        """End a request: its final output with finish_reason "abort", or ``error``."""
        llm = self.llm
        out = None
        if live.rid is None:
            out = aborted_output(live)
        elif live.rid in llm.outputs.requests:
            if not llm.outputs.is_finished(live.rid):
                llm.core.abort_request(live.rid)
                llm.outputs.abort(live.rid)
            out = request_output(self.llm, live) if error is None else None
            llm._owned.discard(live.rid)
            llm.outputs.pop(live.rid)
        post_to(live.loop, live.stream.put, error if error is not None else out)

    def _deliver(self) -> None:
        for key in list(self.live):
            live = self.live[key]
            if live.rid is None:
                continue
            out = request_output(self.llm, live)
            if out is not None:
                post_to(live.loop, live.stream.put, out)
            if self.llm.outputs.is_finished(live.rid):
                del self.live[key]
                self.llm._owned.discard(live.rid)
                self.llm.outputs.pop(live.rid)

    # ---- pause and resume --------------------------------------------------------------------

    def pause(self, mode: str, clear_cache: bool, reply) -> None:
        """``reply`` (loop, future) is settled once the pause holds (mode "wait": drained)."""
        try:
            if mode != "wait":  # the pause holds now: earlier "wait" callers are done
                self._release_drain_waiters()
            was_kept, self.paused = self.paused == "keep", mode
            if mode == "abort":
                self.abort(list(self.live))
            if mode != "keep":
                self._unpark()  # what was kept runs on (mode "wait") or is freed (mode "abort")
            if mode == "wait":
                self.drain_waiters.append((reply, clear_cache))
                return
            if mode == "keep" and (not was_kept or clear_cache):
                if was_kept:  # kept with their KV before: parked again, their blocks freed
                    self._unpark()
                self._park(recompute=clear_cache)
            self.llm._process(self.llm.core.settle())
            if clear_cache:
                self.llm.core.reset_prefix_cache()
        except Exception as e:
            post_to(reply[0], settle_future, reply[1], None, e)
            return
        post_to(reply[0], settle_future, reply[1])

    def resume(self) -> None:
        self._release_drain_waiters(RuntimeError("resumed before the running requests drained"))
        self._unpark()
        self.paused = None
        for live in list(self.live.values()):
            if live.queued is not None:
                self._queue(live, live.queued)

    def _check_drained(self) -> None:
        if self.drain_waiters and not any(live.rid is not None for live in self.live.values()):
            if self.llm.core.is_finished():
                self.llm._process(self.llm.core.settle())
                if any(clear for _, clear in self.drain_waiters):
                    self.llm.core.reset_prefix_cache()
                self._release_drain_waiters()

    def _release_drain_waiters(self, error: BaseException | None = None) -> None:
        waiters, self.drain_waiters = self.drain_waiters, []
        for (loop, future), _ in waiters:
            post_to(loop, settle_future, future, None, error)

    def _park(self, recompute: bool) -> None:
        """Keep the queued sequences out of the scheduler, so the core is idle for weight
        updates; ``recompute``: their KV blocks are freed, so they recompute on resume."""
        core, llm = self.llm.core, self.llm
        if getattr(core, "_launched", None) is not None:  # its tokens come out now
            llm._process(core._resolve())
            self._deliver()
        llm._process(core.settle())
        self._deliver()
        scheduler = getattr(core, "scheduler", None)
        if scheduler is None:  # replicas keep their queues; they are not stepped
            return
        if recompute:
            for seq in reversed(scheduler.running):
                scheduler.preempt(seq, count=False)
            scheduler.running.clear()
            for seq in scheduler.waiting:
                if seq.block_table:  # a chunked prefill in progress
                    scheduler.block_manager.deallocate(seq)
        self.parked = (list(scheduler.running), list(scheduler.waiting))
        scheduler.running.clear()
        scheduler.waiting.clear()

    def _unpark(self) -> None:
        if self.parked is None:
            return
        scheduler = self.llm.core.scheduler
        (running, waiting), self.parked = self.parked, None
        scheduler.running.extendleft(reversed([s for s in running if not s.is_finished]))
        scheduler.waiting.extendleft(reversed([s for s in waiting if not s.is_finished]))
