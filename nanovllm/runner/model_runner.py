"""One tensor-parallel rank: ``run(step) -> step output``. Its parts are composed: the model, the KV
cache (``kv_cache``), the step-input builder (``step_inputs``), CUDA graphs (``cuda_graphs``) and,
on rank 0, the sampler."""

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.step import PromptScoring, SamplingRows, Step
from nanovllm.features import sleep
from nanovllm.features.prompt_logprobs import score_prompt
from nanovllm.layers.attention import Attention, get_attention_backend, resolve_backend_name
from nanovllm.models.llama import head_dim
from nanovllm.models.registry import build_model
from nanovllm.runner import kv_cache
from nanovllm.runner.cuda_graphs import DecodeGraphs
from nanovllm.runner.step_inputs import DecodeBuffer, decode_inputs, prefill_inputs
from nanovllm.runner.step_output import StepOutput
from nanovllm.sampling import Sampler, SamplerOutput
from nanovllm.sampling.batch import make_sampling_batch
from nanovllm.utils.context import Context, step_context
from nanovllm.utils.loader import copy_weight, init_dummy_weights, load_model
from nanovllm.utils.profiling import phase


class ModelRunner:
    def __init__(
        self,
        config: Config,
        rank: int,
        dist_port: int,
        watch: Callable[[], str | None] | None = None,
    ):
        """``watch`` (rank 0 with workers) says which worker has died, if any; device waits check it."""
        self.model = self.kv_cache = self.graphs = self.sampled = self.offloaded = None
        self.rank = rank
        self.owns_group = (
            False  # this rank joined a process group (tensor parallelism) to leave at the end
        )
        try:
            self._start(config, dist_port, watch)
        except BaseException:
            self.release(failed=True)
            raise

    def _start(self, config: Config, dist_port: int, watch) -> None:
        self.config = config
        hf_config = config.hf_config
        self.block_size = config.kvcache_block_size
        self.world_size = config.tensor_parallel_size
        self.watch = watch
        self.head_dim = head_dim(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.num_kv_heads = hf_config.num_key_value_heads // self.world_size  # per rank
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda":
            torch.cuda.set_device(self.rank)
            self.device = torch.device("cuda", self.rank)
        if self.world_size > 1:
            from nanovllm.parallel.group import init_process_group

            init_process_group(self.device, self.rank, self.world_size, dist_port)
            self.owns_group = True
        self.dtype = config.resolved_dtype(self.device.type)
        self.backend = backend = get_attention_backend(
            resolve_backend_name(
                config.attention_backend,
                self.device.type,
                self.block_size,
                self.dtype,
                config.kv_cache_dtype,
                config.weight_quantization,
            )
        )
        # CUDA graphs need a capturable backend on a GPU; the torch backend syncs on the host
        self.enforce_eager = (
            config.enforce_eager or self.device.type == "cpu" or backend.name == "torch"
        )
        if self.world_size > 1 and not self.enforce_eager and not config.disable_custom_all_reduce:
            from nanovllm.parallel.group import enable_custom_all_reduce

            enable_custom_all_reduce(
                self.device, self.dtype
            )  # (only CUDA graphs use it: distributed.all_reduce)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                self.model = build_model(hf_config, config.weight_quantization)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model)
        else:
            load_model(self.model, config.model, hf_config)
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.backend = backend
        self.sampler = Sampler()
        self.offloaded = None  # while asleep: the model's tensors, as sleep.offload left them
        self.host_arena = sleep.HostArena()  # level 1's pinned host copies, kept between sleeps
        self._build_buffers()
        self.num_kvcache_blocks = kv_cache.num_blocks(self)
        self.kv_cache = self.bind_kv_cache(self.num_kvcache_blocks)
        if not self.enforce_eager:
            self.graphs = self.capture_graphs()

    def _build_buffers(self) -> None:
        # each step's sampled ids, where the next step reads the tokens the host does not know yet
        self.sampled = torch.zeros(self.config.max_num_seqs, dtype=torch.int64, device=self.device)
        max_blocks = -(-self.config.max_model_len // self.block_size)
        self.decode_buffer = DecodeBuffer(self.config.max_num_seqs, max_blocks, self.device)

    def bind_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return kv_cache.bind_kv_cache(
            self.model,
            self.config,
            num_blocks,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.device,
        )

    def capture_graphs(self, largest_only: bool = False) -> DecodeGraphs:
        """Decode graphs for batch sizes up to min(max_num_seqs, 512) (see ``DecodeGraphs``)."""
        return DecodeGraphs(
            self.model,
            self.decode_buffer,
            self.sampled,
            min(self.config.max_num_seqs, 512),
            self.dtype,
            self.device,
            self.sync,
            largest_only=largest_only,
        )

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, step: Step) -> StepOutput | None:
        """Launch one step on this rank; rank 0 returns its sampled tokens on their way to the host.
        Every rank keeps them in ``sampled`` (async scheduling), where the next step reads the
        tokens the host does not know yet: a decode graph's draw leaves them there on every rank
        (``drawn``); otherwise rank 0 samples the gathered logits and broadcasts them."""
        n = step.num_seqs
        with phase("inputs"):
            graph_batch = None  # the batch size of the decode graph that runs the step
            if step.is_prefill:
                input_ids, positions, context = prefill_inputs(step, self.block_size, self._tensor)
            else:
                graph_batch = self.graphs.padded_batch(n) if self.graphs is not None else None
                fields = self.decode_buffer.send(step, graph_batch or n, self.block_size)
                if graph_batch is None:
                    input_ids, positions, context = decode_inputs(fields, self.sampled, n)
                else:
                    context = Context(is_prefill=False)
        # every rank knows a plain step's rows (Step.for_workers), so all agree on this
        drawn = graph_batch is not None and step.sampling is not None and step.sampling.plain
        with phase("forward"), step_context(context):
            if step.is_prefill or graph_batch is None:
                hidden_states = self.model(input_ids, positions)
                logits = self.model.compute_logits(hidden_states)
            else:
                logits = self.graphs.replay(n, graph_batch)  # its rows drawn into sampled[:n]
                if not drawn:  # the whole vocabulary's logits on rank 0 (None elsewhere)
                    logits = self.model.lm_head.gather(logits)
        prompt = None  # prompt log-probabilities (rank 0), with the step's output
        if step.prompt_scoring is not None:
            with phase("sample"):
                prompt = score_prompt(
                    self.model, hidden_states, step.prompt_scoring, self.vocab_size
                )
        output = None
        if self.rank == 0 and step.sampling is not None:
            if drawn:
                output = StepOutput(SamplerOutput(self.sampled[:n]), None, self.wait_event)
            else:
                output = self.sample(logits, step.sampling, step.prompt_scoring, prompt)
                if self.config.async_scheduling:
                    self.sampled[:n] = output.device_token_ids
        if self.config.async_scheduling and self.world_size > 1 and not drawn:
            dist.broadcast(self.sampled[:n], 0)
        return output

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        rows: SamplingRows,
        scoring: PromptScoring | None = None,
        prompt: tuple[torch.Tensor, ...] | None = None,
    ) -> StepOutput:
        with phase("sample"):
            out = self.sampler(logits, make_sampling_batch(rows, self.vocab_size, self._tensor))
            num_logprobs = None if out.logprobs is None else [p.logprobs for p in rows.params]
            return StepOutput(out, num_logprobs, self.wait_event, scoring, prompt)

    def _tensor(self, data: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """A host list or NumPy array on this rank's device (pinned and non-blocking on a GPU)."""
        if self.device.type == "cpu":
            return torch.tensor(data, dtype=dtype)
        if isinstance(
            data, np.ndarray
        ):  # torch pins no tensor that NumPy owns: copy into a pinned one
            pinned = torch.empty(data.shape, dtype=dtype, pin_memory=True).copy_(
                torch.from_numpy(data)
            )
        else:
            pinned = torch.tensor(data, dtype=dtype, pin_memory=True)
        return pinned.to(self.device, non_blocking=True)

    # ---- weights in place ---------------------------------------------------------------------

    def plan_weights(self, weights: list[tuple[str, torch.Tensor]]) -> list:
        """Where each ``(checkpoint name, tensor)`` goes; a ValueError, before anything is written,
        for an unknown name or a shape that ``config.json`` does not imply (rank 0 checks). An FP8
        model takes float weights (quantized on load) or float8 weights with their scales."""
        from nanovllm.utils.weights import check_fp8_tensors, plan_weights

        where = " given to update_weights"
        entries = plan_weights(
            self.model, [(name, tensor.shape) for name, tensor in weights], where
        )
        fp8_names = {e.name for e in entries if weights[e.index][1].dtype == torch.float8_e4m3fn}
        return check_fp8_tensors(self.model, entries, fp8_names, where)

    @torch.no_grad()
    def load_weights(self, entries: list, tensors: list[torch.Tensor] | None = None) -> None:
        """Copy planned tensors into the parameters in place, each rank its shard (``copy_weight``).
        Rank 0 has the ``tensors`` (one per entry); with tensor parallelism it broadcasts each one
        from its device, in the parameter's dtype, and the other ranks (called with the entries
        alone) receive it into a buffer of the entry's shape, one tensor at a time. For an FP8
        parameter the tensor travels as float8 values (``entry.fp8``, as bytes) or in float32, to
        be quantized on every rank alike."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for i, entry in enumerate(entries):
            param = params[entry.target]
            tensor = None if tensors is None else tensors[i]
            if self.world_size > 1:
                dtype = param.dtype
                if dtype == torch.float8_e4m3fn and not entry.fp8:
                    dtype = torch.float32
                if tensor is None:
                    tensor = torch.empty(entry.shape, dtype=dtype, device=self.device)
                else:
                    tensor = tensor.to(self.device, dtype).contiguous()
                dist.broadcast(
                    tensor.view(torch.uint8) if entry.fp8 else tensor, 0
                )  # gloo sends no float8
            copy_weight(param, entry, tensor, " given to update_weights")
        self.sync()

    # ---- sleep mode (features/sleep.py) -----------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Free the CUDA graphs, the KV cache (the layers' views with it), the step buffers and the
        model's tensors (level 1: weights kept on the host; level 2: dropped). Only between steps."""
        self.sync()
        self.offloaded = sleep.offload(self.model, level, self.host_arena)
        self._drop_graphs()
        kv_cache.unbind_kv_cache(self.model)
        self.kv_cache = self.sampled = self.decode_buffer = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        sleep.log_device_memory(self.device, f"rank {self.rank} asleep (level {level})")

    def wake_up(self) -> None:
        """Reallocate the model's tensors (level 1's values restored), the KV cache with as many
        blocks as before, the step buffers, and capture the CUDA graphs again. If the device is
        short of memory it raises, and stays asleep (one rank can try again)."""
        sleep.restore(self.offloaded, self.device)
        self._build_buffers()
        self.kv_cache = self.bind_kv_cache(self.num_kvcache_blocks)
        if not self.enforce_eager:
            self.graphs = self.capture_graphs()
        self.sync()
        self.offloaded = None
        sleep.log_device_memory(self.device, f"rank {self.rank} awake")

    # ---- device waits and the end ------------------------------------------------------------

    def sync(self) -> None:
        """Wait for the work queued on this rank's device. With ``watch``, poll instead of
        blocking: a collective that waits on a dead worker would never end."""
        if self.device.type != "cuda":
            return
        if self.watch is None:
            torch.cuda.synchronize()
        else:
            from nanovllm.parallel.group import wait_device

            wait_device(self.watch)

    def wait_event(self, event: torch.cuda.Event) -> None:
        """Wait until ``event`` has passed on this rank's device (polling with ``watch``, see ``sync``)."""
        if self.watch is None:
            event.synchronize()
        else:
            from nanovllm.parallel.group import wait_device

            wait_device(self.watch, event)

    def barrier(self) -> None:
        """All ranks meet here (an all-reduce that rank 0 waits on through ``sync``)."""
        dist.all_reduce(torch.zeros(1, device=self.device))
        self.sync()

    def exit(self) -> None:
        """Leave the group together (every rank runs this)."""
        if self.world_size > 1:
            self.barrier()
        self.sync()
        self.release()

    def release(self, failed: bool = False) -> None:
        """Free this rank's resources. After a failure (a rank died) nothing here talks to the
        other ranks, and NCCL is aborted first so that no device work waits on the dead rank."""
        if self.owns_group:
            from nanovllm.parallel.group import abort_nccl, leave_group
        if failed and self.owns_group and not abort_nccl(self._drop_graphs):
            return  # the device is stuck: freeing memory would wait on it forever
        self._drop_graphs()
        self.model = self.kv_cache = self.sampled = self.offloaded = (
            None  # the layers' cache views go with the model
        )
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        if self.owns_group:
            self.owns_group = False
            leave_group()

    def _drop_graphs(self) -> None:
        self.graphs = None
