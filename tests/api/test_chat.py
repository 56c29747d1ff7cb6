"""``chat``: the tokenizer's chat template applied to conversations, and bad messages
rejected.

The references never come from the code under test: greedy loops over Hugging Face transformers
written in ``api_helpers.py`` (penalties, masked ids and stop conditions applied to its logits),
transformers log-softmax for logprobs, the Hugging Face tokenizer for texts and chat templates, and
exact block ids on fresh engines.
"""

import pytest
from api_helpers import assert_idle, greedy
from hf_reference import assert_greedy_match

# ---- chat ------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]
OTHER_CONVERSATION = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


def chat_ids(tokenizer, conversation, **kwargs) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, return_dict=True, **kwargs
    )
    return list(encoded["input_ids"])


def test_chat_applies_template(full_vocab, hf_ref):
    llm, tok = full_vocab.llm, full_vocab.tokenizer
    expected = chat_ids(tok, CONVERSATION)
    outputs = llm.chat(CONVERSATION, greedy(4), use_tqdm=False)
    assert len(outputs) == 1 and outputs[0]["prompt_token_ids"] == expected
    assert_greedy_match(
        outputs[0]["token_ids"], hf_ref.greedy(full_vocab.path, expected, 4), "chat"
    )

    both = llm.chat([CONVERSATION, OTHER_CONVERSATION], greedy(2), use_tqdm=False)
    assert [o["prompt_token_ids"] for o in both] == [expected, chat_ids(tok, OTHER_CONVERSATION)]

    no_thinking = llm.chat(
        CONVERSATION, greedy(2), use_tqdm=False, chat_template_kwargs={"enable_thinking": False}
    )
    reference = chat_ids(tok, CONVERSATION, enable_thinking=False)
    assert reference != expected
    assert no_thinking[0]["prompt_token_ids"] == reference


@pytest.mark.parametrize(
    "messages, where",
    [
        pytest.param(
            [CONVERSATION, "Name a prime number."], "messages[1]", id="conversation-not-a-list"
        ),
        pytest.param([CONVERSATION, []], "messages[1]", id="empty-conversation"),
        pytest.param([{"content": "no role"}], "messages[0][0]", id="message-without-role"),
        pytest.param(
            CONVERSATION + [{"role": "user"}], "messages[0][2]", id="message-without-content"
        ),
        pytest.param(
            [OTHER_CONVERSATION, [{"role": "user", "content": 5}]],
            "messages[1][0]",
            id="content-not-str",
        ),
        pytest.param(
            [CONVERSATION, [CONVERSATION[0], "hi"]], "messages[1][1]", id="message-not-a-dict"
        ),
    ],
)
def test_chat_rejects_bad_messages(full_vocab, messages, where):
    llm = full_vocab.llm
    with pytest.raises(TypeError) as e:
        llm.chat(messages, greedy(2), use_tqdm=False)
    assert where in str(e.value), str(e.value)
    assert_idle(llm)


def test_chat_rejects_non_list(full_vocab):
    with pytest.raises(TypeError, match="messages"):
        full_vocab.llm.chat("Name a prime number.", greedy(2), use_tqdm=False)
    assert_idle(full_vocab.llm)
