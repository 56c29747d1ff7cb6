"""Data-parallel replicas as Ray actors (``data_parallel_backend="ray"``)."""

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nanovllm.parallel.replica import (
    ReplicaCall,
    ReplicaControl,
    ReplicaDied,
    ReplicaReply,
    ReplicaServer,
)

PLACEMENT_TIMEOUT = 300.0  # seconds to wait for a replica's GPUs to be free on the cluster


class RayReplica:
    """The front end's handle on one replica actor; the same calls as ``ProcessReplica``."""

    def __init__(self, index: int, config, eos_token_ids: list[int], num_gpus: int):
        self.index = index
        self.busy = False
        self.ref = None  # the submitted call's result
        self.num_kvcache_blocks = 0
        self.stats: dict = {}
        bundle = {"CPU": 1, "GPU": num_gpus} if num_gpus else {"CPU": 1}
        self.placement_group = placement_group([bundle], strategy="STRICT_PACK")
        strategy = PlacementGroupSchedulingStrategy(
            self.placement_group, placement_group_bundle_index=0
        )
        actor_class = ray.remote(ReplicaServer).options(
            num_cpus=1, num_gpus=num_gpus, scheduling_strategy=strategy, name=None, max_restarts=0
        )
        self.actor = actor_class.remote(config, eos_token_ids)

    @staticmethod
    def placements(config) -> list[int]:
        """GPUs of each replica's actor: ``tensor_parallel_size``, or 0 on the CPU."""
        if not ray.is_initialized():
            ray.init()
        dp, tp = config.data_parallel_size, config.tensor_parallel_size
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if config.device == "cuda" and not gpus:
            raise ValueError(
                "Config.device is 'cuda' but the Ray cluster has no GPU; use 'cpu' or 'auto'"
            )
        num_gpus = tp if gpus and config.device != "cpu" else 0
        if num_gpus and dp * tp > gpus:
            raise ValueError(
                f"Config.data_parallel_size={dp} × tensor_parallel_size={tp} needs {dp * tp} GPUs, "
                f"but the Ray cluster has {gpus}"
            )
        return [num_gpus] * dp

    def wait_ready(self) -> None:
        if not self.placement_group.wait(PLACEMENT_TIMEOUT):
            raise RuntimeError(
                f"data-parallel replica {self.index}: the Ray cluster found no room for its "
                f"bundle in {PLACEMENT_TIMEOUT:.0f} s"
            )
        self.ref, self.busy = self.actor.ready.remote(), True
        self.num_kvcache_blocks, self.stats = self.result()

    def submit(self, call: ReplicaCall | ReplicaControl) -> None:
        method = self.actor.control if isinstance(call, ReplicaControl) else self.actor.call
        self.ref, self.busy = method.remote(call), True

    def result(self) -> ReplicaReply | bool | None:
        # the replica's own error is raised as an instance of its type
        try:
            return ray.get(self.ref)
        except RayActorError as e:
            raise ReplicaDied(f"data-parallel replica {self.index} (Ray actor) died: {e}") from e
        finally:
            self.busy = False

    @staticmethod
    def wait(replicas: list["RayReplica"], timeout: float | None = None) -> list["RayReplica"]:
        refs = {r.ref: r for r in replicas if r.busy}
        ready, rest = ray.wait(list(refs), num_returns=1, timeout=timeout)
        if rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        return [refs[ref] for ref in ready]

    def exit(self, timeout: float = 30.0) -> None:
        if self.actor is None:
            return
        try:
            if self.busy:
                ray.wait([self.ref], timeout=timeout)
            ray.get(self.actor.exit.remote(), timeout=timeout)
        except Exception:  # a dead actor, or one that did not start
            pass
        ray.kill(self.actor)
        remove_placement_group(self.placement_group)
        self.actor, self.busy = None, False
