"""vLLM's prompt dicts: ``TextPrompt`` and ``TokensPrompt``."""

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str  # the text the ids came from, reported as ``RequestOutput.prompt``


def unpack(prompt, where: str):
    """vLLM's ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` as the text or the ids."""
    keys = sorted(prompt)
    if keys not in (["prompt"], ["prompt_token_ids"], ["prompt", "prompt_token_ids"]):
        msg = "{'prompt': str} or {'prompt_token_ids': [int, ...]} (multi-modal data, embeddings"
        raise ValueError(
            f"{where}: a prompt dict must be {msg} and salts are not supported), got keys {keys}"
        )
    return prompt.get("prompt_token_ids", prompt.get("prompt"))
