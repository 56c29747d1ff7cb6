"""One tensor-parallel rank: ``run(step) -> StepOutput`` (docs/runner.md)."""

import random
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.step import SamplingRows, Step
from nanovllm.layers.attention import Attention, get_attention_backend, resolve_backend_name
from nanovllm.models.llama import head_dim
from nanovllm.models.registry import build_model
from nanovllm.runner import kv_cache
from nanovllm.runner.step_inputs import DecodeBuffer, decode_inputs, prefill_inputs
from nanovllm.runner.step_output import StepOutput
from nanovllm.sampling.sampler import Sampler, make_sampling_batch
from nanovllm.utils.context import Context, step_context
from nanovllm.utils.loader import load_model
from nanovllm.utils.profiling import phase


class RankZeroOnly:
    """A ``collective_rpc`` argument only rank 0 receives (the others get None)."""

    def __init__(self, value):
        self.value = value


def check_parallel() -> None:
    """The layers shard over the process's default group: there must be none yet."""
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialised in this process (another "
            "tensor-parallel LLM's, or the program's own): exit() that LLM, or use a new process"
        )


class ModelRunner:
    def __new__(cls, config: Config, *args, **kwargs):
        mixins = []  # the runner's parts of features that change the model
        if config.lora_config is not None:  # adapters: lora/runner.py
            from nanovllm.lora.runner import LoRARunner

            mixins.append(LoRARunner)
        if kv_cache.kv_layers(config.hf_config) < config.hf_config.num_hidden_layers:
            from nanovllm.runner.state_runner import StateRunner  # hybrid models' states

            mixins.append(StateRunner)
        if mixins and cls is ModelRunner:
            cls = type("ModelRunner", (*mixins, ModelRunner), {})
        return super().__new__(cls)

    def __init__(self, config: Config, rank: int, dist_port: int, watch: Callable = None):
        self.model = self.kv_cache = self.graphs = self.sampled = None
        self.rank = rank
        self.watch = watch  # rank 0 with workers: names a dead worker; device waits poll it
        self.owns_group = False  # joined a process group (tensor parallelism) to leave at the end
        try:
            self._start(config, dist_port)
        except BaseException:
            self.release(failed=True)
            raise

    def _start(self, config: Config, dist_port: int) -> None:
        self.config = config
        hf_config = config.hf_config
        self.block_size = config.kvcache_block_size
        self.world_size = config.tensor_parallel_size
        self.head_dim = head_dim(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.num_kv_heads = max(1, hf_config.num_key_value_heads // self.world_size)
        if (seed := config.seed) is not None:  # the process's generators too, as vLLM seeds them
            random.seed(seed), np.random.seed(seed % 2**32), torch.manual_seed(seed)
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda":
            torch.cuda.set_device(self.rank)
            self.device = torch.device("cuda", self.rank)
        if self.world_size > 1:
            from nanovllm.parallel.group import init_process_group

            init_process_group(self.device, self.rank, self.world_size, dist_port)
            self.owns_group = True
        self.dtype = config.resolved_dtype(self.device.type)
        args = (self.device.type, self.block_size, self.dtype, config.kv_cache_dtype)
        name = resolve_backend_name(config.attention_backend, *args, config.weight_quantization)
        self.backend = backend = get_attention_backend(name)
        # CUDA graphs need a capturable backend on a GPU; the torch backend syncs on the host
        eager = config.enforce_eager or self.device.type == "cpu" or backend.name == "torch"
        self.enforce_eager = eager
        if self.world_size > 1 and not self.enforce_eager and not config.disable_custom_all_reduce:
            from nanovllm.parallel.group import enable_custom_all_reduce

            enable_custom_all_reduce(self.device, self.dtype)  # (only CUDA graphs use it)
        self.model = self.make_model(config)
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.backend = backend
        self.sampler = Sampler()
        self._build_buffers()
        self.num_kvcache_blocks = kv_cache.num_blocks(self)
        self.allocate_cache(buffers=False)

    def make_model(self, config: Config):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                model = build_model(config.hf_config, config.weight_quantization)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":  # drawn from the seed, alike on every replica
            from nanovllm.utils.checkpoint import init_dummy_weights

            init_dummy_weights(model, (config.seed or 0) - config.seed_offset)
        else:
            load_model(model, config.model, config.hf_config)
        return model

    def _build_buffers(self) -> None:
        # each step's sampled ids, where the next step reads the tokens the host does not know yet
        self.sampled = torch.zeros(self.config.max_num_seqs, dtype=torch.int64, device=self.device)
        max_blocks = -(-self.config.max_model_len // self.block_size)
        self.decode_buffer = DecodeBuffer(self.config.max_num_seqs, max_blocks, self.device)

    def bind_kv_cache(self, num_blocks: int) -> torch.Tensor:
        shape = (num_blocks, self.num_kv_heads, self.head_dim)
        return kv_cache.bind_kv_cache(self.model, self.config, *shape, self.dtype, self.device)

    def capture_graphs(self, largest_only: bool = False):
        from nanovllm.runner.cuda_graphs import DecodeGraphs  # a GPU's only

        return DecodeGraphs(self, largest_only)

    def allocate_cache(self, buffers: bool = True) -> None:
        if buffers:
            self._build_buffers()
        self.kv_cache = self.bind_kv_cache(self.num_kvcache_blocks)
        if not self.enforce_eager:
            self.graphs = self.capture_graphs()
        self.sync()

    @torch.inference_mode()
    def run(self, step: Step) -> StepOutput | None:
        """Launch one step; rank 0 returns its output. Every rank keeps the tokens in ``sampled``
        (a decode graph draws them there, or rank 0 samples and broadcasts them)."""
        n = step.num_seqs
        with phase("inputs"):
            graph_batch = None  # the batch size of the decode graph that runs the step
            if step.is_prefill:
                input_ids, positions, context = prefill_inputs(step, self.block_size, self._tensor)
            else:
                graph_batch = self.graphs.padded_batch(n) if self.graphs is not None else None
                graphed = graph_batch is not None
                turn = self.decode_buffer.send(step, graph_batch or n, self.block_size, graphed)
                if graph_batch is None:
                    fields = self.decode_buffer.fields
                    input_ids, positions, context = decode_inputs(fields, self.sampled, n)
                else:
                    context = Context(is_prefill=False)
        # every rank knows a plain step's rows (Step.for_workers), so all agree on this
        drawn = graph_batch is not None and step.sampling is not None and step.sampling.plain
        with phase("forward"), step_context(context):
            if graph_batch is None:
                hidden_states = self.model(input_ids, positions)
                logits = self.model.compute_logits(hidden_states)
            else:
                logits = self.graphs.replay(n, graph_batch, turn)
                if not drawn:  # the whole vocabulary's logits on rank 0 (None elsewhere)
                    logits = self.model.lm_head.gather(logits)
        prompt = None  # prompt log-probabilities (rank 0)
        if step.prompt_scoring is not None:
            from nanovllm.sampling.prompt_scoring import score_prompt

            with phase("sample"):
                scoring = step.prompt_scoring
                prompt = score_prompt(self.model, hidden_states, scoring, self.vocab_size)
        output = None
        if self.rank == 0 and step.sampling is not None:
            if drawn:
                output = self.graphs.output(n, turn, self.sync)
            else:
                output = self.sample(logits, step.sampling, step.prompt_scoring, prompt)
                if self.config.async_scheduling:
                    self.sampled[:n] = output.device_token_ids
        if self.config.async_scheduling and self.world_size > 1 and not drawn:
            dist.broadcast(self.sampled[:n], 0)
        return output

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: SamplingRows, scoring=None, prompt=None):
        with phase("sample"):
            out = self.sampler(logits, make_sampling_batch(rows, self.vocab_size, self._tensor))
            extra = None
            if rows.extra is not None or prompt is not None:
                from nanovllm.sampling.extras import ExtraOutputs

                extra = ExtraOutputs(out, rows.extra, scoring, prompt)
            return StepOutput(out.token_ids, self.sync, extra)

    def _tensor(self, data: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(data, dtype=dtype)
        if isinstance(data, np.ndarray):  # torch pins no tensor NumPy owns: copy into a pinned one
            pinned = torch.empty(data.shape, dtype=dtype, pin_memory=True)
            pinned.copy_(torch.from_numpy(data))
        else:
            pinned = torch.tensor(data, dtype=dtype, pin_memory=True)
        return pinned.to(self.device, non_blocking=True)

    def rpc(self, method, args: tuple = (), kwargs: dict | None = None):
        fn = getattr(self, method) if isinstance(method, str) else partial(method, self)
        return fn(*args, **(kwargs or {}))

    def sync(self, event: torch.cuda.Event | None = None) -> None:
        """Wait for ``event`` (default: all queued work); with ``watch``, by polling."""
        if self.device.type != "cuda":
            return
        if self.watch is not None:
            from nanovllm.parallel.group import wait_device

            wait_device(self.watch, event)
        elif event is not None:
            event.synchronize()
        else:
            torch.cuda.synchronize()

    def exit(self) -> None:
        """Every rank runs this: the ranks leave the group together."""
        if self.world_size > 1:
            dist.all_reduce(torch.zeros(1, device=self.device))
        self.sync()
        self.release()

    def release(self, failed: bool = False) -> None:
        """Free this rank's resources; after a failure, NCCL is aborted first."""
        if self.owns_group:
            from nanovllm.parallel.group import abort_nccl, leave_group

            if failed and not abort_nccl(lambda: setattr(self, "graphs", None)):
                return  # the device is stuck: freeing memory would wait on it forever
        self.graphs = self.model = self.kv_cache = self.sampled = None  # cache views go with model
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        if self.owns_group:
            self.owns_group = False
            leave_group()
