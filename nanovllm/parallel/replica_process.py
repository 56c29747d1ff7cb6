"""Data-parallel replicas in processes of this host (``data_parallel_backend="mp"``)."""

import multiprocessing as mp
import os
import pickle
import signal
from multiprocessing.connection import wait as wait_handles

from nanovllm.parallel.control_channel import release_channels
from nanovllm.parallel.replica import (
    ReplicaCall,
    ReplicaControl,
    ReplicaDied,
    ReplicaReply,
    ReplicaServer,
)


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _replica_main(conn, config, eos_token_ids: list[int], visible_devices: str | None) -> None:
    # a terminal's Ctrl-C reaches every process of its group: the front end alone decides what it
    # means (its call's requests are aborted), and tells the replicas through their calls
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if visible_devices is not None:  # before anything touches CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    else:  # on the CPU the replicas share the cores (each would otherwise take them all)
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // config.data_parallel_size))
    try:
        server = ReplicaServer(config, eos_token_ids)
    except BaseException as e:
        conn.send(_picklable(e))
        return
    try:
        conn.send(server.ready())
        while True:
            try:
                call = conn.recv()
            except EOFError:  # the front end is gone
                break
            if call is None:
                break
            try:
                reply = (
                    server.control(call) if isinstance(call, ReplicaControl) else server.call(call)
                )
            except Exception as e:
                reply = _picklable(e)
            conn.send(reply)
    finally:
        server.exit()


class ProcessReplica:
    """Handle on one replica process: ``submit`` a call, ``wait``, then take its ``result``."""

    def __init__(self, index: int, config, eos_token_ids: list[int], visible_devices: str | None):
        ctx = mp.get_context("spawn")
        self.index = index
        self.busy = False  # a call is on its way or being served
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_replica_main,
            args=(child, config, eos_token_ids, visible_devices),
            name=f"nanovllm-replica{index}",  # no daemon: with tensor parallelism it has workers
        )
        self.process.start()
        child.close()  # so that a dead replica reads as the end of the pipe
        self.num_kvcache_blocks = 0
        self.stats: dict = {}

    @staticmethod
    def placements(config) -> list[str | None]:
        # replica r gets GPUs r*M ... r*M+M-1 (M: the tensor-parallel size)
        if config.resolved_device() != "cuda":
            return [None] * config.data_parallel_size
        tp, devices = config.tensor_parallel_size, _gpu_ids()
        return [",".join(devices[i * tp : (i + 1) * tp]) for i in range(config.data_parallel_size)]

    def wait_ready(self) -> None:
        self.busy = True
        self.num_kvcache_blocks, self.stats = self.result()

    def failure(self) -> str:
        self.process.join(1.0)  # its sentinel fires a moment before the exit status can be read
        release_channels(self.process.pid)
        pid, code = self.process.pid, self.process.exitcode
        return f"data-parallel replica {self.index} (pid {pid}) exited with code {code}"

    def submit(self, call: ReplicaCall | ReplicaControl) -> None:
        try:
            self.conn.send(call)
        except OSError as e:  # the pipe broke: the replica has died
            raise ReplicaDied(self.failure()) from e
        self.busy = True

    def result(self) -> ReplicaReply | bool | None:
        """Waits for the reply; the replica's error is raised as is, its death as ReplicaDied."""
        try:
            reply = self.conn.recv()
        except (EOFError, OSError) as e:
            self.busy = False
            raise ReplicaDied(self.failure()) from e
        self.busy = False
        if isinstance(reply, BaseException):
            raise reply
        return reply

    @staticmethod
    def wait(
        replicas: list["ProcessReplica"], timeout: float | None = None
    ) -> list["ProcessReplica"]:
        """The replicas whose reply is ready or that died (blocking up to ``timeout``)."""
        handles = {}
        for replica in replicas:
            handles[replica.process.sentinel] = replica
            if replica.busy:
                handles[replica.conn] = replica
        ready = wait_handles(list(handles), timeout)
        return list(dict.fromkeys(handles[h] for h in ready))

    def exit(self, timeout: float = 30.0) -> None:
        if self.process.is_alive():
            try:
                if self.busy and self.conn.poll(timeout):
                    self.conn.recv()
                self.conn.send(None)
            except (OSError, EOFError):
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if self.process.exitcode != 0:
            release_channels(self.process.pid)
        self.conn.close()
        self.busy = False


def _gpu_ids() -> list[str]:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    ids = ids[: torch.cuda.device_count()]
    return ids
