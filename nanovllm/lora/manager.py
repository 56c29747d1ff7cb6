"""The engine core's adapters: loaded ones on the host, the device slots, and each request's
slot as a request processor (docs/lora.md)."""

from collections import OrderedDict
from itertools import count

import xxhash

from nanovllm.features.processors import RequestProcessor
from nanovllm.lora.adapter import Adapter, load_adapter
from nanovllm.lora.request import LoRARequest


class AdapterManager:
    """Up to ``max_cpu_loras`` adapters on the host (least recently used dropped first, never one
    in use or pinned); ``max_loras`` device slots. Invariants: an adapter that a queued or running
    sequence uses (``users``) stays loaded and is not replaced; a slot whose ``holders`` has a
    sequence that has not finished keeps its adapter."""

    def __init__(self, core):
        self.core, lc = core, core.config.lora_config
        self.max_rank, self.max_cpu_loras = lc.max_lora_rank, lc.max_cpu_loras
        self.loaded: OrderedDict[int, Adapter] = OrderedDict()
        self.slots: list[int | None] = [None] * lc.max_loras  # the adapter id in each slot
        self.holders: list[set] = [set() for _ in range(lc.max_loras)]
        self.users: dict[int, set] = {}  # adapter id -> its sequences, queued or running
        self.pinned: set[int] = set()
        self.serials = count(1)

    def add(self, request: LoRARequest) -> Adapter:
        """The adapter of ``request``, loaded unless known (``load_inplace``: replaced)."""
        if not isinstance(request, LoRARequest):
            msg = f"must be a LoRARequest, got {type(request).__name__}"
            raise TypeError(f"lora_request {msg}")
        adapter_id, known = request.lora_int_id, self.loaded.get(request.lora_int_id)
        if known is not None and not request.load_inplace:
            self.loaded.move_to_end(adapter_id)
            return known
        if known is not None and self.in_use(adapter_id):
            raise ValueError(
                f"LoRA adapter {adapter_id} ({known.name!r}) cannot be replaced while requests "
                "are queued or run with it; replace it once they finish"
            )
        hf_config = self.core.config.hf_config
        adapter = load_adapter(request, hf_config, self.max_rank, next(self.serials))
        self._unload(adapter_id)
        self.loaded[adapter_id] = adapter
        self.loaded.move_to_end(adapter_id)
        for old in [i for i in self.loaded if i not in self.pinned and not self.in_use(i)]:
            if len(self.loaded) <= self.max_cpu_loras:
                break
            if old != adapter_id:
                self._unload(old)
                del self.loaded[old]
        return adapter

    def remove(self, adapter_id: int) -> bool:
        if adapter_id not in self.loaded:
            return False
        if self.in_use(adapter_id):
            raise ValueError(f"LoRA adapter {adapter_id} is in use by queued or running requests")
        self._unload(adapter_id)
        del self.loaded[adapter_id]
        self.pinned.discard(adapter_id)
        return True

    def pin(self, adapter_id: int) -> bool:
        if adapter_id not in self.loaded:
            raise ValueError(f"LoRA adapter {adapter_id} is not loaded; add_lora() it first")
        if adapter_id not in self.pinned and len(self.pinned) == len(self.slots):
            msg = f"all {len(self.slots)} device slots (max_loras) hold pinned adapters"
            raise ValueError(f"cannot pin LoRA adapter {adapter_id}: {msg}")
        self.pinned.add(adapter_id)
        return True

    def in_use(self, adapter_id: int) -> bool:
        users = {q for q in self.users.get(adapter_id, ()) if not q.is_finished}
        self.users[adapter_id] = users
        return bool(users)

    def _unload(self, adapter_id: int) -> None:
        for s, held in enumerate(self.slots):
            if held == adapter_id:
                self.slots[s], self.holders[s] = None, set()

    def slot_for(self, seq, adapter: Adapter) -> int | None:
        """The slot ``seq`` runs on; a free one is loaded with its adapter, else None."""
        adapter_id = adapter.request.lora_int_id
        for s in range(len(self.slots)):
            self.holders[s] = {q for q in self.holders[s] if not q.is_finished}
            if self.slots[s] == adapter_id:
                self.holders[s].add(seq)
                return s
        free = [s for s in range(len(self.slots)) if self.slots[s] is None]
        free += [s for s in range(len(self.slots)) if not self.holders[s]]
        free = [s for s in free if self.slots[s] not in self.pinned]
        if not free:
            return None
        slot = free[0]
        self.core.collective_rpc("load_lora", (slot, adapter.weights))
        self.slots[slot], self.holders[slot] = adapter_id, {seq}
        return slot


class AdapterRows(RequestProcessor):
    """A sequence of an adapter: it starts once the adapter has a slot, and its rows of every
    step name that slot."""

    def __init__(self, manager: AdapterManager, adapter: Adapter):
        self.manager, self.adapter, self.slot = manager, adapter, -1

    def admit(self, seq) -> bool:
        slot = self.manager.slot_for(seq, self.adapter)
        self.slot = -1 if slot is None else slot
        return slot is not None

    def contribute(self, step, row: int, seq, offset: int) -> None:
        if step.adapters is None:
            step.adapters = [-1] * step.num_seqs
        step.adapters[row] = self.slot


def manager(core) -> AdapterManager:
    if core.config.lora_config is None:
        msg = "LoRA is off: create the LLM with enable_lora=True (and max_loras, max_lora_rank)"
        raise ValueError(f"a lora_request was given but {msg}")
    if "lora" not in core.shared:
        core.shared["lora"] = AdapterManager(core)
    return core.shared["lora"]


def adapter_rows(core, request: LoRARequest):
    """``rows(seq)``: the processor of a sequence of ``request``'s adapter, whose prefix-cache
    blocks are keyed by this load of the adapter."""
    adapters = manager(core)
    adapter = adapters.add(request)
    adapter_id = request.lora_int_id
    if len(adapters.pinned) == len(adapters.slots) and adapter_id not in adapters.pinned:
        msg = f"every device slot (max_loras={len(adapters.slots)}) holds a pinned adapter"
        raise ValueError(f"LoRA adapter {adapter_id} cannot run: {msg}")
    salt = xxhash.xxh64_intdigest(f"lora:{adapter.serial}".encode())

    def rows(seq) -> AdapterRows:
        seq.cache_salt = salt
        adapters.users.setdefault(adapter_id, set()).add(seq)
        return AdapterRows(adapters, adapter)

    return rows


def call(core, method: str, *args):
    """``add``/``remove``/``pin``/``list`` on a core's adapters (a replica's too)."""
    adapters = manager(core)
    if method == "list":
        return set(adapters.loaded)
    result = getattr(adapters, method)(*args)
    return True if method == "add" else result
