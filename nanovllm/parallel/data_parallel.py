"""``data_parallel_size`` engine cores (replicas) behind ``EngineCore``'s interface
(design: docs/parallel.md)."""

import copy
import threading
from dataclasses import dataclass

from nanovllm.engine.core import SeqOutput
from nanovllm.parallel.replica import ReplicaCall, ReplicaControl, ReplicaDied, ReplicaReply
from nanovllm.parallel.shield import shielded
from nanovllm.sampling_params import SamplingParams

SUMMED_STATS = (
    "num_requests_running",
    "num_requests_waiting",
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


@dataclass
class Routed:
    replica: int
    tokens: int  # what it adds to its replica's load
    open_seqs: set[int]  # its sequences that have not finished


def replica_class(backend: str):
    if backend == "ray":
        from nanovllm.parallel.replica_ray import RayReplica

        return RayReplica
    from nanovllm.parallel.replica_process import ProcessReplica

    return ProcessReplica


def start_replicas(config, eos_token_ids: list[int]) -> list:
    """Start the replicas and wait until each is ready; if one fails, all are stopped."""
    cls = replica_class(config.data_parallel_backend)
    replicas = []
    try:
        for i, placement in enumerate(cls.placements(config)):
            replica_config = copy.copy(config)  # replica i of a seeded engine draws from seed + i
            if config.seed is not None:
                replica_config.seed, replica_config.seed_offset = config.seed + i, i
            replicas.append(cls(i, replica_config, eos_token_ids, placement))
        for replica in replicas:
            replica.wait_ready()
    except BaseException:
        for replica in replicas:
            replica.exit(timeout=5.0)
        raise
    return replicas


class DataParallelCore:
    """Every exchange with the replicas runs ``shielded``, so Ctrl-C never splits one."""

    def __init__(self, config, eos_token_ids: list[int]):
        self.replicas = start_replicas(config, eos_token_ids)
        self.owner = threading.get_ident()  # the thread that steps: it alone talks to them
        self.wait = type(self.replicas[0]).wait
        self.num_kvcache_blocks = min(r.num_kvcache_blocks for r in self.replicas)
        n = len(self.replicas)
        self.calls = [ReplicaCall() for _ in range(n)]  # what each replica's next call delivers
        self.has_work = [False] * n  # its last reply left work queued or in flight
        self.load = [0] * n  # outstanding tokens of the requests routed to it
        self.requests: dict[int, Routed] = {}  # request id -> where it went, until it ends
        self.held: list[ReplicaReply] = []  # replies taken early (``stats``), for the next step
        self.failure_message: str | None = None

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        report_every_step: bool = False,
        lora=None,
    ) -> None:
        i = min(range(len(self.replicas)), key=lambda r: (self.load[r], r))
        n = sampling_params.n
        tokens = n * (len(prompt_token_ids) + sampling_params.max_tokens)
        self.load[i] += tokens
        self.requests[request_id] = Routed(i, tokens, set(range(request_id, request_id + n)))
        # the replica unpickles the params when the call goes out: a copy keeps them as they are now
        self.calls[i].adds.append(
            (request_id, prompt_token_ids, copy.deepcopy(sampling_params), report_every_step, lora)
        )

    def abort_request(self, request_id: int) -> bool:
        routed = self.requests.pop(request_id, None)
        if routed is None:
            return False
        self.load[routed.replica] -= routed.tokens
        self.calls[routed.replica].aborts.append(request_id)
        return True

    def finish_sequence(self, seq_id: int, request_id: int) -> None:
        routed = self.requests.get(request_id)
        if routed is not None and seq_id in routed.open_seqs:
            self.calls[routed.replica].finishes.append((seq_id, request_id))
            self._ended(request_id, seq_id)

    def _ended(self, request_id: int, seq_id: int) -> None:
        routed = self.requests.get(request_id)
        if routed is None:
            return
        routed.open_seqs.discard(seq_id)
        if not routed.open_seqs:
            del self.requests[request_id]
            self.load[routed.replica] -= routed.tokens

    # ---- steps -------------------------------------------------------------------------------

    def step(self) -> tuple[list[SeqOutput], int]:
        """Returns the ready replies' outputs, and the prefill tokens (> 0) or, when none,
        minus the sequences decoded."""
        self.owner = threading.get_ident()  # the stepping thread (AsyncLLM's is not the first)
        with shielded():
            for i, replica in enumerate(self.replicas):
                if not replica.busy and (self.has_work[i] or self.calls[i]):
                    self._submit(i, step=True)
            outputs, prefill, decode = [], 0, 0
            for reply in self._replies():
                outputs += reply.outputs
                if reply.num_tokens > 0:
                    prefill += reply.num_tokens
                else:
                    decode -= reply.num_tokens
        return outputs, prefill or -decode

    def settle(self) -> list[SeqOutput]:
        """Deliver what is queued and take every reply: nothing is left in flight."""
        outputs = []
        with shielded():
            while True:
                for i, replica in enumerate(self.replicas):
                    if not replica.busy and self.calls[i]:
                        self._submit(i, step=False)
                if not (self.held or any(r.busy for r in self.replicas)):
                    return outputs
                for reply in self._replies():
                    outputs += reply.outputs

    def _submit(self, i: int, step: bool) -> None:
        call, self.calls[i] = self.calls[i], ReplicaCall()
        call.step = step
        self._send(i, call)

    def _send(self, i: int, message: ReplicaCall | ReplicaControl) -> None:
        try:
            self.replicas[i].submit(message)
        except ReplicaDied as e:
            self._fail(str(e), e)

    def _replies(self) -> list[ReplicaReply]:
        replies, self.held = self.held, []
        if any(r.busy for r in self.replicas):
            for replica in self.wait(self.replicas, 0 if replies else None):
                replies.append(self._take(replica))
        return replies

    def _take(self, replica) -> ReplicaReply:
        try:
            reply = replica.result()
        except ReplicaDied as e:
            self._fail(str(e), e)
        self.has_work[replica.index] = not reply.finished
        replica.stats = reply.stats
        for out in reply.outputs:
            if out.finish_reason is not None:
                self._ended(out.request_id, out.seq_id)
        return reply

    # ---- every replica, between steps ---------------------------------------------------------

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """One entry per replica; every replica gets the call even when one raises."""
        results = self._control("collective_rpc", method, tuple(args), kwargs)
        return [result[0] for result in results]

    def reset_prefix_cache(self) -> bool:
        return all(self._control("reset_prefix_cache"))

    def lora(self, method: str, *args) -> list:
        """``lora.manager.call`` on every replica's core."""
        return self._control("lora", method, *args)

    def preempt_all(self) -> None:
        """Every replica frees every block (``features/idle.preempt_all``); its stats follow."""
        for replica, stats in zip(self.replicas, self._control("preempt_all")):
            replica.stats = stats

    def _control(self, method: str, *args) -> list:
        results, error = [], None
        with shielded():
            self.settle_calls()
            for i in range(len(self.replicas)):
                self._send(i, ReplicaControl(method, args))
            for replica in self.replicas:
                try:
                    results.append(replica.result())
                except ReplicaDied as e:
                    self._fail(str(e), e)
                except Exception as e:
                    error = error or e
        if error is not None:
            raise error
        return results

    def settle_calls(self) -> None:
        for replica in self.replicas:
            if replica.busy:
                self.held.append(self._take(replica))

    def _fail(self, failure: str, cause: BaseException):
        self.failure_message = f"{failure}; the engine has stopped, create a new LLM to continue"
        self.exit()
        raise RuntimeError(self.failure_message) from cause

    # ---- counts and the end ------------------------------------------------------------------

    def is_finished(self) -> bool:
        busy = any(r.busy for r in self.replicas)
        return not (any(self.has_work) or any(self.calls) or busy or self.held)

    def stats(self) -> dict:
        """The replicas' counts summed, each one's under ``replicas``; what is queued is
        delivered first, so the counts include it (from another thread: the last reported)."""
        mine = threading.get_ident() == self.owner
        if self.failure_message is None and any(self.calls) and mine:
            with shielded():
                self.settle_calls()
                for i, replica in enumerate(self.replicas):
                    if self.calls[i]:
                        self._submit(i, step=False)
                        self.held.append(self._take(replica))
        per = [r.stats for r in self.replicas]
        total = {key: sum(s[key] for s in per) for key in SUMMED_STATS}
        blocks = [r.num_kvcache_blocks for r in self.replicas]
        usage = sum(s["kv_cache_usage"] * b for s, b in zip(per, blocks))
        total["kv_cache_usage"] = usage / sum(blocks)
        queries = total["prefix_cache_queries"]
        total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / queries if queries else 0.0
        total["replicas"] = per
        return total

    def exit(self) -> None:
        for replica in self.replicas:
            replica.exit(timeout=30.0 if self.failure_message is None else 2.0)
