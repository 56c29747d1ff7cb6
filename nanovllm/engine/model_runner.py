"""One tensor-parallel rank: the model, its KV cache, per-step inputs and (on GPU) CUDA graphs."""
import gc
import multiprocessing as mp
import os
import pickle
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.sampling_batch import make_sampling_batch
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import prepare_decode, prepare_prefill
from nanovllm.layers.attention import Attention, get_attention_backend, resolve_backend_name
from nanovllm.layers.sampler import Sampler
from nanovllm.models.qwen3 import Qwen3ForCausalLM, head_dim
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.context import Context, step_context
from nanovllm.utils.distributed import abort_nccl, wait_device
from nanovllm.utils.loader import load_model

# share of GPU memory kept out of the KV cache for what sizing cannot see: allocator fragmentation
# over many step shapes, and kernels loaded after start-up (measured overshoot without it: 0.5%)
GPU_HEADROOM = 0.01
CPU_KV_CACHE_SHARE = 0.25  # on CPU, num_kvcache_blocks=-1 takes this share of available memory


class ModelRunner:
    def __init__(self, config: Config, rank: int, dist_port: int, shm_name: str, events: list[Event] | Event,
                 watch: Callable[[], str | None] | None = None):
        """``watch`` (rank 0 with workers) says which worker has died, if any; device waits check it."""
        self.shm, self.model, self.kv_cache, self.graphs = None, None, None, None
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
            resolve_backend_name(config.attention_backend, self.device.type, self.block_size)
        )
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                self.model = Qwen3ForCausalLM(hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_model(self.model, config.model)
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.backend = self.backend
        # CUDA graphs need a capturable backend on a GPU; the torch backend syncs on the host
        self.enforce_eager = config.enforce_eager or self.device.type == "cpu" or self.backend.name == "torch"
        self.sampler = Sampler()
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
        self.model = self.kv_cache = None  # the layers' cache views go with the model
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

    # ---- start-up ----------------------------------------------------------------------------

    def warmup_model(self) -> int:
        """One prefill of the largest batch (and one sampling of the largest decode batch), so the
        KV cache is sized from the true peak. Returns the peak bytes reserved above what stays."""
        gc.collect()  # what an earlier engine left behind must not count as in use
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        max_tokens = self.config.max_num_batched_tokens
        seq_len = min(self.config.max_model_len, max_tokens)
        num_seqs = max(1, min(max_tokens // seq_len, self.config.max_num_seqs))
        seqs = []
        for _ in range(num_seqs):
            seq = Sequence([0] * seq_len, SamplingParams(), self.block_size)
            seq.num_scheduled_tokens = len(seq)
            seqs.append(seq)
        self.run(seqs, True)
        if self.rank == 0:  # the sampler's heaviest path: penalties, top-p past its candidates, logprobs
            params = SamplingParams(top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5, logprobs=20, min_tokens=1)
            seqs = [Sequence([0] * 8, params, self.block_size) for _ in range(min(self.config.max_num_seqs, 512))]
            logits = torch.zeros(len(seqs), self.vocab_size, dtype=self.dtype, device=self.device)
            self.sample(seqs, logits)
            del logits
        peak = torch.cuda.max_memory_reserved() - torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        return peak

    def measure_graph_memory(self) -> int:
        """Bytes the CUDA-graph pool will hold: capture the largest decode graph over a one-block
        cache, then release it. (All graphs share one pool, which the largest one sizes.) This also
        loads the decode kernels, whose code takes device memory outside torch."""
        self.bind_kv_cache(1)
        self.sync()
        before = torch.cuda.memory_reserved()
        self.capture_cudagraph(largest_only=True)
        graph_bytes = torch.cuda.memory_reserved() - before
        self._drop_graphs()
        del self.kv_cache
        torch.cuda.empty_cache()
        return graph_bytes

    def allocate_kv_cache(self) -> int:
        """Size the cache (all ranks agree on the minimum) and allocate it.

        On GPU with ``num_kvcache_blocks=-1``: blocks = (total * (gpu_memory_utilization - headroom)
        - in use - activation peak - graph pool) // block_bytes, where "in use" counts every
        process's memory on the device."""
        num_blocks = self.config.num_kvcache_blocks
        block_bytes = self.kv_cache_block_bytes()
        if num_blocks == -1:
            if self.device.type == "cuda":
                peak = self.warmup_model()
                graph_bytes = 0 if self.enforce_eager else self.measure_graph_memory()
                free, total = torch.cuda.mem_get_info()
                budget = int(total * (self.config.gpu_memory_utilization - GPU_HEADROOM))
                budget -= (total - free) + peak + graph_bytes
            else:
                available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
                blocks_per_seq = -(-self.config.max_model_len // self.block_size)
                budget = min(int(available * CPU_KV_CACHE_SHARE), self.config.max_num_seqs * blocks_per_seq * block_bytes)
            num_blocks = budget // block_bytes
        if self.world_size > 1:
            t = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            self.sync()
            num_blocks = int(t.item())
        if num_blocks <= 0:
            raise RuntimeError(
                f"no KV-cache block fits in memory (one block takes {block_bytes / 2**20:.1f} MiB); "
                "raise gpu_memory_utilization, or lower max_num_batched_tokens / max_model_len"
            )
        self.bind_kv_cache(num_blocks)
        return num_blocks

    def kv_cache_block_bytes(self) -> int:
        layers = self.config.hf_config.num_hidden_layers
        return 2 * layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def bind_kv_cache(self, num_blocks: int) -> None:
        """The one place that knows the cache layout: one tensor
        [2, layers, blocks, block_size, kv_heads, head_dim]; each layer gets its K and V views."""
        self.kv_cache = torch.empty(
            2, self.config.hf_config.num_hidden_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
            dtype=self.dtype, device=self.device,
        )
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for i, module in enumerate(layers):
            module.k_cache = self.kv_cache[0, i]
            module.v_cache = self.kv_cache[1, i]

    # ---- per-step inputs ---------------------------------------------------------------------

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list on this rank's device (pinned and non-blocking on a GPU)."""
        if self.device.type == "cpu":
            return torch.tensor(data, dtype=dtype)
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    # ---- running a step ----------------------------------------------------------------------

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        if context.is_prefill or self.graphs is None or not self.graphs.fits(input_ids.size(0)):
            hidden_states = None
        else:
            hidden_states = self.graphs.replay(input_ids, positions, context)
        with step_context(context):
            if hidden_states is None:
                hidden_states = self.model(input_ids, positions)
            return self.model.compute_logits(hidden_states)

    def run(self, seqs: list[Sequence], is_prefill: bool) -> tuple[list[int], list | None] | None:
        """Compute one step; rank 0 returns one sampled token id per sequence, and (when any
        sequence asks for them) one ``(logprob, {token_id: logprob})`` or None per sequence."""
        prepare = prepare_prefill if is_prefill else prepare_decode
        input_ids, positions, context = prepare(seqs, self.block_size, self._tensor)
        logits = self.run_model(input_ids, positions, context)
        if self.rank != 0:
            return None
        return self.sample(seqs, logits)

    @torch.inference_mode()
    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list | None]:
        out = self.sampler(logits, make_sampling_batch(seqs, self.vocab_size, self.device, self._tensor))
        self.sync()
        token_ids = out.token_ids.tolist()
        if out.logprobs is None:
            return token_ids, None
        logprobs = [None] * len(seqs)
        sampled, top_values, top_ids = (t.tolist() for t in out.logprobs)
        rows = (i for i, seq in enumerate(seqs) if seq.sampling_params.logprobs is not None)
        for i, lp, values, ids in zip(rows, sampled, top_values, top_ids):
            n = seqs[i].sampling_params.logprobs
            entry = dict(zip(ids[:n], values[:n]))
            entry[token_ids[i]] = lp
            logprobs[i] = (lp, entry)
        return token_ids, logprobs

    def capture_cudagraph(self, largest_only: bool = False) -> None:
        """Decode graphs for batch sizes up to min(max_num_seqs, 512) (see ``DecodeGraphs``)."""
        cfg = self.config
        self.graphs = DecodeGraphs(
            self.model, min(cfg.max_num_seqs, 512), -(-cfg.max_model_len // self.block_size),
            cfg.hf_config.hidden_size, self.dtype, self.device, self.sync, largest_only,
        )
