"""The front end's input side: prompts of every form and their sampling params, checked and turned
into token ids (all or nothing per call), and conversations through the chat template."""

from collections.abc import Callable

from nanovllm.engine.requests import as_prompt_list, prompt_token_ids
from nanovllm.sampling_params import SamplingParams


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        block_size: int,
        num_kvcache_blocks: int,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kvcache_blocks = num_kvcache_blocks

    def check(self, prompt, sampling_params: SamplingParams, where: str) -> list[int]:
        """One request's prompt token ids, with its params checked against the model and the
        cache; ``where`` names it in error messages."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                f"{where}: sampling_params must be a SamplingParams, got {type(sampling_params).__name__}"
            )
        token_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size, where)
        for t in sampling_params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(
                    f"{where}: stop_token_ids holds {t}, outside the vocabulary [0, {self.vocab_size})"
                )
        max_len = self.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"{where}: the prompt has {len(token_ids)} tokens; max_model_len={max_len} leaves room for "
                f"prompts of at most {max_len - 1} tokens"
            )
        longest = min(len(token_ids) + sampling_params.max_tokens, max_len)
        blocks = -(-longest // self.block_size)
        if blocks > self.num_kvcache_blocks:
            raise ValueError(
                f"{where}: prompt ({len(token_ids)} tokens) plus max_tokens ({sampling_params.max_tokens}) needs up "
                f"to {blocks} KV-cache blocks of {self.block_size} tokens, but the whole cache holds "
                f"{self.num_kvcache_blocks}"
            )
        return token_ids

    def check_all(
        self, prompts, sampling_params, default: Callable[[], SamplingParams]
    ) -> list[tuple[list[int], SamplingParams]]:
        """Every prompt of a call and its params (one for all, one per prompt, or None for
        ``default()``), checked before any is queued."""
        prompts = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = default()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(sampling_params)} entries but there are {len(prompts)} prompts"
                )
        else:
            sampling_params = [sampling_params] * len(prompts)
        return [
            (self.check(p, sp, f"prompts[{i}]"), sp)
            for i, (p, sp) in enumerate(zip(prompts, sampling_params))
        ]

    def chat_prompts(self, messages, chat_template_kwargs: dict | None) -> list[list[int]]:
        """Conversations (one, or a list of them; each a list of ``{"role", "content"}`` dicts)
        through the tokenizer's chat template, with the assistant's turn opened."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, (list, tuple)):
            raise TypeError(
                f"messages must be a conversation or a list of conversations, got {type(messages).__name__}"
            )
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(
                f"chat_template_kwargs must be a dict or None, got {type(chat_template_kwargs).__name__}"
            )
        return [self._chat_prompt(c, i, chat_template_kwargs or {}) for i, c in enumerate(messages)]

    def _chat_prompt(self, conversation, i: int, template_kwargs: dict) -> list[int]:
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise TypeError(
                f"messages[{i}]: a conversation must be a non-empty list of message dicts, got {conversation!r}"
            )
        for j, m in enumerate(conversation):
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise TypeError(
                    f"messages[{i}][{j}]: a message must be a dict with str 'role' and 'content', got {m!r}"
                )
        encoded = self.tokenizer.apply_chat_template(
            list(conversation),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **template_kwargs,
        )
        return list(encoded["input_ids"])
