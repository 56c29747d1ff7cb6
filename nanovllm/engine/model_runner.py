"""One tensor-parallel rank: the model, its KV cache (sized in ``kv_cache.py``), per-step inputs and
(on GPU) CUDA graphs; rank 0 sends each call to the workers through shared memory."""
import multiprocessing as mp
import pickle
import time
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.kv_cache import KVCacheAllocator
from nanovllm.engine.sampling_batch import make_sampling_batch, plain_sampling
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import prepare_decode, prepare_prefill
from nanovllm.engine.step_output import StepOutput
from nanovllm.layers.attention import Attention, get_attention_backend, resolve_backend_name
from nanovllm.layers.sampler import Sampler, SamplerOutput
from nanovllm.models.llama import head_dim
from nanovllm.models.registry import model_class
from nanovllm.utils.context import Context, step_context
from nanovllm.utils.distributed import abort_nccl, wait_device
from nanovllm.utils.loader import init_dummy_weights, load_model


class ModelRunner(KVCacheAllocator):
    def __init__(self, config: Config, rank: int, dist_port: int, shm_name: str, events: list[Event] | Event,
                 watch: Callable[[], str | None] | None = None):
        """``watch`` (rank 0 with workers) says which worker has died, if any; device waits check it."""
        self.shm, self.model, self.kv_cache, self.graphs, self.sampled = None, None, None, None, None
        try:
            self._start(config, rank, dist_port, shm_name, events, watch)
        except BaseException:
            self.release(failed=True)
            raise

    def _start(self, config, rank, dist_port, shm_name, events, watch) -> None:
        self.config = config
        hf_config = config.hf_config
        self.block_size = config.kvcache_block_size
        self.world_size = config.tensor_parallel_size
        self.rank = rank
        self.events = events
        self.watch = watch
        self.head_dim = head_dim(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.num_kv_heads = hf_config.num_key_value_heads // self.world_size  # per rank
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda":
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        if self.world_size > 1:
            dist.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo",
                init_method=f"tcp://127.0.0.1:{dist_port}",
                world_size=self.world_size,
                rank=rank,
                device_id=self.device if self.device.type == "cuda" else None,
            )
        self.dtype = config.resolved_dtype(self.device.type)
        self.backend = get_attention_backend(
            resolve_backend_name(
                config.attention_backend, self.device.type, self.block_size, self.dtype, config.kv_cache_dtype
            )
        )
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                self.model = model_class(hf_config)(hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model)
        else:
            load_model(self.model, config.model)
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.backend = self.backend
        # CUDA graphs need a capturable backend on a GPU; the torch backend syncs on the host
        self.enforce_eager = config.enforce_eager or self.device.type == "cpu" or self.backend.name == "torch"
        self.sampler = Sampler()
        self.rng = np.random.default_rng()  # the draw seeds of unseeded requests
        # each step's sampled ids, where the next step reads the tokens the host does not know yet
        self.sampled = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.num_kvcache_blocks = self.allocate_kv_cache()
        if not self.enforce_eager:
            self.capture_cudagraph()

        if self.world_size > 1:
            if rank == 0:
                self.shm = SharedMemory(name=shm_name, create=True, size=self.control_channel_bytes())
                self.barrier()
            else:
                self.barrier()
                self.shm = SharedMemory(name=shm_name)
                self.loop()

    # ---- control channel (rank 0 -> workers) -------------------------------------------------

    def control_channel_bytes(self) -> int:
        """Room for the largest step message: every scheduled token and block-table entry at
        their pickled worst case (5 bytes), plus per-sequence overhead; at least 1 MiB."""
        cfg = self.config
        max_blocks = -(-cfg.max_model_len // self.block_size)
        worst = cfg.max_num_batched_tokens * 5 + cfg.max_num_seqs * (max_blocks * 5 + 512)
        return max(1 << 20, worst + (64 << 10))

    def exit(self) -> None:
        """Leave the group together (every rank runs this through the control channel)."""
        if self.world_size > 1:
            self.barrier()
        self.sync()
        self.release()

    def release(self, failed: bool = False) -> None:
        """Free this rank's resources. After a failure (a rank died) nothing here talks to the
        other ranks, and NCCL is aborted first so that no device work waits on the dead rank."""
        if self.shm is not None:
            self.shm.close()
            if self.rank == 0:
                self.shm.unlink()
            self.shm = None
        if failed and not abort_nccl(self._drop_graphs):
            return  # the device is stuck: freeing memory would wait on it forever
        self._drop_graphs()
        self.model = self.kv_cache = self.sampled = None  # the layers' cache views go with the model
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # an aborted group may refuse a clean teardown
                pass

    def sync(self) -> None:
        """Wait for the work queued on this rank's device. With ``watch``, poll instead of
        blocking: a collective that waits on a dead worker would never end."""
        if self.device.type != "cuda":
            return
        if self.watch is None:
            torch.cuda.synchronize()
        else:
            wait_device(self.watch)

    def _drop_graphs(self) -> None:
        self.graphs = None

    def barrier(self) -> None:
        """All ranks meet here (an all-reduce that rank 0 waits on through ``sync``)."""
        dist.all_reduce(torch.zeros(1, device=self.device))
        self.sync()

    def loop(self) -> None:
        while True:
            method_name, args = self.read_shm()
            self.call(method_name, *args)
            if method_name == "exit":
                break

    def read_shm(self) -> tuple[str, list]:
        parent = mp.parent_process()
        while not self.events.wait(1.0):
            if parent is not None and not parent.is_alive():  # the engine is gone: nobody will call
                raise SystemExit(1)
        n = int.from_bytes(self.shm.buf[0:4], "little")
        method_name, *args = pickle.loads(self.shm.buf[4 : n + 4])
        self.events.clear()
        return method_name, args

    def write_shm(self, method_name: str, *args) -> None:
        """Send one call to the workers, once each has taken the previous one: rank 0 may run a step
        ahead of them (its collectives return before the workers join them on a GPU)."""
        for event in self.events:
            while event.is_set():
                if self.watch is not None and (failure := self.watch()):
                    raise RuntimeError(failure)
                time.sleep(0)
        data = pickle.dumps([method_name, *args])
        n = len(data)
        if n + 4 > self.shm.size:
            raise ValueError(
                f"control message for {method_name!r} is {n} bytes, more than the {self.shm.size - 4}-byte channel"
            )
        self.shm.buf[0:4] = n.to_bytes(4, "little")
        self.shm.buf[4 : n + 4] = data
        for event in self.events:
            event.set()

    def call(self, method_name: str, *args):
        if self.world_size > 1 and self.rank == 0:
            self.write_shm(method_name, *args)
        return getattr(self, method_name)(*args)

    # ---- per-step inputs ---------------------------------------------------------------------

    def _tensor(self, data: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """A host list or NumPy array on this rank's device (pinned and non-blocking on a GPU)."""
        if self.device.type == "cpu":
            return torch.tensor(data, dtype=dtype)
        if isinstance(data, np.ndarray):  # torch pins no tensor that NumPy owns: copy into a pinned one
            pinned = torch.empty(data.shape, dtype=dtype, pin_memory=True).copy_(torch.from_numpy(data))
        else:
            pinned = torch.tensor(data, dtype=dtype, pin_memory=True)
        return pinned.to(self.device, non_blocking=True)

    # ---- running a step ----------------------------------------------------------------------

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """The logits of an eager step (on ranks other than 0 with tensor parallelism: None)."""
        with step_context(context):
            return self.model.compute_logits(self.model(input_ids, positions))

    def run(self, seqs: list[Sequence], is_prefill: bool, prev_rows: list[int] | None = None) -> StepOutput | None:
        """Launch one step; rank 0 returns its sampled tokens on their way to the host.
        ``prev_rows``: where a sequence's input token is a placeholder, its row in the previous
        step's sampled ids, which stay on the device (-1: the host sent the token)."""
        if not is_prefill and self.graphs is not None and self.graphs.fits(len(seqs)):
            return self._run_graph(seqs, prev_rows)
        prepare = prepare_prefill if is_prefill else prepare_decode
        input_ids, positions, context = prepare(seqs, self.block_size, self._tensor)
        if prev_rows is not None:
            rows = self._tensor(prev_rows, torch.int64)
            input_ids = torch.where(rows >= 0, self.sampled[rows.clamp(min=0)], input_ids)
        return self._finish(seqs, self.run_model(input_ids, positions, context))

    def _run_graph(self, seqs: list[Sequence], prev_rows: list[int] | None) -> StepOutput | None:
        """A decode step as a graph replay. Where every row samples plainly (temperature and seed),
        the graph has drawn the tokens; otherwise the sampler runs on the graph's logits."""
        plain = self.rank == 0 and self.graphs.sample
        sampling = plain_sampling(seqs, self.rng) if plain else None
        out = self.graphs.replay(seqs, self.block_size, prev_rows, sampling)
        if not self.graphs.sample:  # the hidden states: tensor parallelism gathers the logits on rank 0
            with torch.inference_mode(), step_context(Context(is_prefill=False)):
                out = self.model.compute_logits(out)
        return self._finish(seqs, out, drawn=sampling is not None)

    def _finish(self, seqs: list[Sequence], logits: torch.Tensor | None, drawn: bool = False) -> StepOutput | None:
        """Sample on rank 0 (unless the graph has drawn: ``drawn``) and keep the ids in ``sampled``,
        where the next step's placeholders are read on every rank."""
        n = len(seqs)
        output = None
        if self.rank == 0:
            if drawn:
                output = StepOutput(seqs, SamplerOutput(self.sampled[:n]), self.wait_event)
            else:
                output = self.sample(seqs, logits)
                if self.config.async_scheduling:
                    self.sampled[:n] = output.device_token_ids
        if self.config.async_scheduling and self.world_size > 1:
            dist.broadcast(self.sampled[:n], 0)
        return output

    @torch.inference_mode()
    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> StepOutput:
        out = self.sampler(logits, make_sampling_batch(seqs, self.vocab_size, self.device, self._tensor))
        return StepOutput(seqs, out, self.wait_event)

    def wait_event(self, event: torch.cuda.Event) -> None:
        """Wait until ``event`` has passed on this rank's device (polling with ``watch``, see ``sync``)."""
        if self.watch is None:
            event.synchronize()
        else:
            wait_device(self.watch, event)

    def capture_cudagraph(self, largest_only: bool = False) -> None:
        """Decode graphs for batch sizes up to min(max_num_seqs, 512) (see ``DecodeGraphs``)."""
        cfg = self.config
        self.graphs = DecodeGraphs(
            self.model, min(cfg.max_num_seqs, 512), -(-cfg.max_model_len // self.block_size),
            cfg.hf_config.hidden_size, self.vocab_size, self.dtype, self.device, self.sync, self.sampled,
            sample=self.world_size == 1, largest_only=largest_only,
        )
