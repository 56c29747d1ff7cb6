"""The front end's LoRA calls: ``lora_request`` on a call, and ``add_lora``/``remove_lora``/
``list_loras``/``pin_lora`` (vLLM's ``LLMEngine`` methods)."""

from dataclasses import replace

from nanovllm.lora.request import LoRARequest


def core_call(core, method: str, *args):
    """``lora.manager.call`` on the engine core, or on every data-parallel replica's."""
    if hasattr(core, "replicas"):
        results = core.lora(method, *args)
        return set().union(*results) if method == "list" else all(results)
    from nanovllm.lora.manager import call

    return call(core, method, *args)


def with_adapters(llm, requests: list, lora_request) -> list:
    """Each checked request with its LoRARequest (or None); each adapter is loaded (checked)
    once, before anything is queued."""
    many = isinstance(lora_request, (list, tuple))
    per = list(lora_request) if many else [lora_request] * len(requests)
    if len(per) != len(requests):
        msg = f"has {len(per)} entries for {len(requests)} prompts; give one per prompt, or one"
        raise ValueError(f"lora_request {msg}")
    loaded = {}
    for request in per:
        if request is not None and not isinstance(request, LoRARequest):
            msg = f"a LoRARequest, a list of them (or None), got {type(request).__name__}"
            raise TypeError(f"lora_request must be {msg}")
        if request is not None and request.lora_int_id not in loaded:
            add_lora(llm, request)
            loaded[request.lora_int_id] = replace(request, load_inplace=False)
    return [(*r, loaded[q.lora_int_id] if q else None) for r, q in zip(requests, per)]


def add_lora(llm, lora_request: LoRARequest) -> bool:
    """Load (check) an adapter now; ``load_inplace=True`` replaces one under its id."""
    llm._check_running()
    return core_call(llm.core, "add", lora_request)


def remove_lora(llm, lora_id: int) -> bool:
    llm._check_running()
    return core_call(llm.core, "remove", lora_id)


def list_loras(llm) -> set[int]:
    llm._check_running()
    return core_call(llm.core, "list")


def pin_lora(llm, lora_id: int) -> bool:
    """Keep the adapter loaded (on the host and, once it has one, in its device slot)."""
    llm._check_running()
    return core_call(llm.core, "pin", lora_id)
