"""Conversations to prompt token ids through the tokenizer's chat template (``LLM.chat``)."""


def chat_prompts(tokenizer, messages, chat_template_kwargs: dict | None) -> list[list[int]]:
    """Conversations (one, or a list) through the chat template, the assistant's turn opened."""
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
        messages = [messages]
    if not isinstance(messages, (list, tuple)):
        got = type(messages).__name__
        raise TypeError(f"messages must be a conversation or a list of conversations, got {got}")
    kwargs = chat_template_kwargs
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict or None, got {type(kwargs).__name__}")
    prompts = []
    for i, conversation in enumerate(messages):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            msg = f"a conversation must be a non-empty list of message dicts, got {conversation!r}"
            raise TypeError(f"messages[{i}]: {msg}")
        for j, m in enumerate(conversation):
            fields = ("role", "content")
            if not (isinstance(m, dict) and all(isinstance(m.get(k), str) for k in fields)):
                msg = f"a message must be a dict with str 'role' and 'content', got {m!r}"
                raise TypeError(f"messages[{i}][{j}]: {msg}")
        opts = dict(add_generation_prompt=True, tokenize=True, return_dict=True, **(kwargs or {}))
        encoded = tokenizer.apply_chat_template(list(conversation), **opts)
        prompts.append(list(encoded["input_ids"]))
    return prompts


def chat(llm, messages, sampling_params=None, use_tqdm=True, chat_template_kwargs=None) -> list:
    """``generate`` on conversations rendered by the tokenizer's chat template."""
    llm._check_running()
    prompts = chat_prompts(llm.tokenizer, messages, chat_template_kwargs)
    return llm.generate(prompts, sampling_params, use_tqdm)
