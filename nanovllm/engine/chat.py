"""Conversations to prompts through the tokenizer's chat template (``LLM.chat``, vLLM's)."""

import json
import re

FORMATS = ("auto", "string", "openai")
# a template that loops over a message's content takes OpenAI-style parts (vLLM's "auto")
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\.content\b|\[['\"]content['\"]\])")


def _conversations(messages) -> list:
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
        return [messages]
    if not isinstance(messages, (list, tuple)):
        got = type(messages).__name__
        raise TypeError(f"messages must be a conversation or a list of conversations, got {got}")
    return list(messages)


def _text_parts(content: list, where: str) -> list[str]:
    texts = []
    for k, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                raise TypeError(f"{where}: content part {k} needs a str 'text', got {part!r}")
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            msg = f"content part {k} has type {kind!r}; only text parts are supported"
            raise ValueError(f"{where}: {msg} ({{'type': 'text', 'text': ...}})")
    return texts


def _message(m, where: str, openai: bool) -> dict:
    """One message as the template takes it: text content (a str, or text parts for a template
    that loops over them); tool_calls' JSON arguments as dicts (as vLLM passes them)."""
    content = m.get("content", "") if isinstance(m, dict) else None
    tool_call = isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
    if content is None and tool_call:
        content = ""
    if not (
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and "content" in m
        and isinstance(content, (str, list))
    ):
        msg = "a message must be a dict with a str 'role' and a 'content' (a str or text parts)"
        raise TypeError(f"{where}: {msg}, got {m!r}")
    texts = [content] if isinstance(content, str) else _text_parts(content, where)
    out = dict(m)
    out["content"] = [{"type": "text", "text": t} for t in texts] if openai else "\n".join(texts)
    if tool_call:
        out["tool_calls"] = [_tool_call(c, where) for c in m["tool_calls"]]
    return out


def _tool_call(call, where: str):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments", {}), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: tool call arguments are not JSON ({e}): {call!r}") from e
    return {**call, "function": {**function, "arguments": arguments}}


def render(tokenizer, messages, options: dict) -> list[dict]:
    """``{"prompt_token_ids": ids, "prompt": text}`` per conversation."""
    template = options["chat_template"]
    content_format = options["chat_template_content_format"]
    if content_format not in FORMATS:
        raise ValueError(
            f"chat_template_content_format must be one of {FORMATS}, got {content_format!r}"
        )
    if content_format == "auto":
        source = template if template is not None else tokenizer.chat_template
        content_format = "openai" if _LOOPS_OVER_CONTENT.search(str(source or "")) else "string"
    kwargs = options["chat_template_kwargs"]
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict or None, got {type(kwargs).__name__}")
    kwargs = {
        **(kwargs or {}),
        "chat_template": template,
        "tools": options["tools"],
        "add_generation_prompt": options["add_generation_prompt"],
        "continue_final_message": options["continue_final_message"],
        "tokenize": False,
    }
    prompts = []
    for i, conversation in enumerate(_conversations(messages)):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            msg = f"a conversation must be a non-empty list of message dicts, got {conversation!r}"
            raise TypeError(f"messages[{i}]: {msg}")
        openai = content_format == "openai"
        rendered = [_message(m, f"messages[{i}][{j}]", openai) for j, m in enumerate(conversation)]
        text = tokenizer.apply_chat_template(rendered, **kwargs)
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template wrote them
        prompts.append({"prompt_token_ids": ids, "prompt": text})
    return prompts


def _check_options(o: dict) -> None:
    for name in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(o[name], bool):
            raise TypeError(f"{name} must be a bool, got {o[name]!r}")
    if o["add_generation_prompt"] and o["continue_final_message"]:
        raise ValueError(
            "continue_final_message=True continues the last message, so add_generation_prompt "
            "must be False (got both True)"
        )
    if o["chat_template"] is not None and not isinstance(o["chat_template"], str):
        raise TypeError(f"chat_template must be a str or None, got {o['chat_template']!r}")
    if o["tools"] is not None and not isinstance(o["tools"], list):
        raise TypeError(f"tools must be a list of dicts or None, got {o['tools']!r}")
    unsupported = {
        "tokenization_kwargs": (o["tokenization_kwargs"], "None or {} (the template's tokens)"),
        "mm_processor_kwargs": (o["mm_processor_kwargs"], "None or {} (no multi-modal input)"),
    }
    for name, (value, allowed) in unsupported.items():
        if value not in (None, {}):
            raise ValueError(f"chat: {name} must be {allowed}, got {value!r}")
    priority = o["priority"]
    if priority is not None and any(p != 0 for p in _as_list(priority)):
        raise ValueError(
            f"chat: priority must be None or 0 (first come, first served), got {priority!r}"
        )


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def chat(
    llm,
    messages,
    sampling_params=None,
    use_tqdm=True,
    lora_request=None,
    priority=None,
    chat_template: str | None = None,
    chat_template_content_format: str = "auto",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list | None = None,
    chat_template_kwargs: dict | None = None,
    tokenization_kwargs: dict | None = None,
    mm_processor_kwargs: dict | None = None,
) -> list:
    """``generate`` on conversations rendered by the chat template; ``RequestOutput.prompt`` is
    the rendered text."""
    llm._check_running()
    options = dict(locals())
    _check_options(options)
    prompts = render(llm.tokenizer, messages, options)
    return llm.generate(prompts, sampling_params, use_tqdm, lora_request)
