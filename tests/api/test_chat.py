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


# ---- vLLM's chat options -------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
]


def rendered(tok, conversation, **kwargs) -> str:
    kwargs = {"add_generation_prompt": True} | kwargs
    return tok.apply_chat_template(conversation, tokenize=False, **kwargs)


def test_chat_options_render_as_the_template(full_vocab):
    llm, tok = full_vocab.llm, full_vocab.tokenizer
    out = llm.chat(CONVERSATION, greedy(1), use_tqdm=False)[0]
    assert out.prompt == rendered(tok, CONVERSATION)

    out = llm.chat(CONVERSATION, greedy(1), use_tqdm=False, tools=TOOLS)[0]
    assert out.prompt == rendered(tok, CONVERSATION, tools=TOOLS) and "get_weather" in out.prompt

    tool_calls = [dict(m) for m in TOOL_CONVERSATION]
    tool_calls[1] = {**tool_calls[1], "content": ""}
    tool_calls[1]["tool_calls"] = [
        {**c, "function": {**c["function"], "arguments": {"city": "Paris"}}}
        for c in TOOL_CONVERSATION[1]["tool_calls"]
    ]
    out = llm.chat(TOOL_CONVERSATION, greedy(1), use_tqdm=False, tools=TOOLS)[0]
    assert out.prompt == rendered(tok, tool_calls, tools=TOOLS) and "sunny" in out.prompt

    out = llm.chat(OTHER_CONVERSATION, greedy(1), use_tqdm=False, add_generation_prompt=False)[0]
    assert out.prompt == rendered(tok, OTHER_CONVERSATION, add_generation_prompt=False)

    partial = CONVERSATION + [{"role": "assistant", "content": "Seven is"}]
    kwargs = dict(add_generation_prompt=False, continue_final_message=True)
    out = llm.chat(partial, greedy(1), use_tqdm=False, **kwargs)[0]
    assert out.prompt == rendered(tok, partial, **kwargs) and out.prompt.endswith("Seven is")
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    out = llm.chat(CONVERSATION, greedy(1), use_tqdm=False, chat_template=template)[0]
    assert out.prompt == "[system] You are terse.\n[user] Name a prime number.\n"

    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}
    ]
    out = llm.chat(parts, greedy(1), use_tqdm=False)[0]
    assert out.prompt == rendered(tok, [{"role": "user", "content": "Hi\n!"}])
    assert_idle(llm)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(continue_final_message=True), ValueError, "add_generation_prompt"),
        (dict(lora_request=object()), TypeError, "lora_request must be a LoRARequest"),
        (dict(mm_processor_kwargs={"a": 1}), ValueError, "mm_processor_kwargs"),
        (dict(tokenization_kwargs={"truncation": True}), ValueError, "tokenization_kwargs"),
        (dict(priority=1), ValueError, "priority"),
        (dict(chat_template_content_format="xml"), ValueError, "chat_template_content_format"),
    ],
)
def test_chat_refuses_options(full_vocab, kwargs, error, words):
    llm = full_vocab.llm
    with pytest.raises(error, match=words):
        llm.chat(CONVERSATION, greedy(1), use_tqdm=False, **kwargs)
    assert_idle(llm)


def test_chat_refuses_other_content_parts(full_vocab):
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, image]}]
    with pytest.raises(ValueError, match="image_url"):
        full_vocab.llm.chat(messages, greedy(1), use_tqdm=False)
    assert_idle(full_vocab.llm)
