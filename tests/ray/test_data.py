"""``nanovllm.ray``: Ray Data batch inference, on a local CPU Ray cluster (one per module).

The reference is the engine used directly: ``LLM.generate`` / ``LLM.chat`` in this process, with
the same engine settings, on each row's request. The processor's rows must equal it exactly: token
ids, text, counts and finish reason. Row checks and Arrow types are tested on one engine replica in
this process (fast, exact exception types); what Ray adds (the actor pool, pre/postprocess, errors
reaching the driver) through Ray Data.
"""

import json
import os
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("ray.data", reason="the ray extra is not installed (pip install -e '.[ray]')")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import ray  # noqa: E402
import ray.data  # noqa: E402
import torch  # noqa: E402

from nanovllm.ray import ProcessorConfig, build_llm_processor  # noqa: E402
from nanovllm.ray.data import _EngineReplica  # noqa: E402
from nanovllm.utils.checkpoint import make_random_checkpoint  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")  # Ray's own

ROOT = str(Path(__file__).resolve().parents[2])
ENGINE = dict(
    device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256, max_num_seqs=8
)
DEFAULT_MAX_TOKENS = (
    5  # in the test model's generation_config.json: rows that do not set max_tokens
)
OUTPUT_COLUMNS = (
    "generated_text",
    "generated_tokens",
    "num_input_tokens",
    "num_generated_tokens",
    "finish_reason",
)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]
OTHER_CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


def token_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 150000) for _ in range(length)]


def greedy(max_tokens: int, **kwargs) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, **kwargs}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A tiny random Qwen3 with the whole Qwen3 vocabulary (any text tokenizes, chat templates
    work); its generation_config.json recommends Qwen3's sampling settings and
    DEFAULT_MAX_TOKENS."""
    path = make_random_checkpoint(
        str(tmp_path_factory.mktemp("qwen3-ray")), dtype=torch.float32, seed=3, std=0.3
    )
    with open(os.path.join(path, "generation_config.json")) as f:
        generation_config = json.load(f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({**generation_config, "max_new_tokens": DEFAULT_MAX_TOKENS}, f)
    return path


@pytest.fixture(scope="module")
def replica(model_path):
    """An engine replica in this process; its ``llm`` is the reference."""
    engine = _EngineReplica(model_path, ENGINE)
    yield engine
    engine.llm.exit()


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster whose workers import this checkout's nanovllm."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    # the tests' preprocess/postprocess use this module's helpers, which the workers cannot import
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    context = ray.data.DataContext.get_current()
    progress_bars, context.enable_progress_bars = context.enable_progress_bars, False
    try:
        yield
    finally:
        context.enable_progress_bars = progress_bars
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()


def expected(llm, request: dict) -> dict:
    """The output columns that ``generate``/``chat`` give for a row's request: the model folder's
    default sampling params with the row's over them."""
    sampling_params = replace(
        llm.get_default_sampling_params(), **(request.get("sampling_params") or {})
    )
    if "messages" in request:
        out = llm.chat(
            request["messages"],
            sampling_params,
            use_tqdm=False,
            chat_template_kwargs=request.get("chat_template_kwargs"),
        )[0]
    else:
        out = llm.generate([request["prompt"]], sampling_params, use_tqdm=False)[0]
    return {
        "generated_text": out["text"],
        "generated_tokens": out["token_ids"],
        "num_input_tokens": len(out["prompt_token_ids"]),
        "num_generated_tokens": len(out["token_ids"]),
        "finish_reason": out["finish_reason"],
    }


def outputs_of(row: dict) -> dict:
    assert isinstance(row["generated_tokens"], list), type(row["generated_tokens"])
    return {k: row[k] for k in OUTPUT_COLUMNS}


def mixed_rows(llm) -> list[dict]:
    """Text prompts, token-id prompts and conversations with per-row sampling params: greedy with
    different max_tokens, a stop string and a stop token id taken from the greedy continuation (so
    that they end it), a seeded row that sets only max_tokens and seed (the model folder's
    temperature, top-k and top-p under them), and a row without sampling params."""
    text = expected(llm, {"prompt": "The stop string", "sampling_params": greedy(16)})[
        "generated_text"
    ]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    tokens = expected(llm, {"prompt": token_prompt(2, 9), "sampling_params": greedy(16)})[
        "generated_tokens"
    ]
    return [
        {"id": 0, "prompt": "Hello, Nano-vLLM.", "sampling_params": greedy(8)},
        {"id": 1, "prompt": token_prompt(1, 12), "sampling_params": greedy(5)},
        {
            "id": 2,
            "messages": CHAT,
            "sampling_params": greedy(6),
            "chat_template_kwargs": {"enable_thinking": False},
        },
        {"id": 3, "messages": OTHER_CHAT, "sampling_params": {"max_tokens": 7, "seed": 11}},
        {"id": 4, "prompt": "The stop string", "sampling_params": greedy(16, stop=[stop])},
        {
            "id": 5,
            "prompt": token_prompt(2, 9),
            "sampling_params": greedy(16, stop_token_ids=[tokens[3]]),
        },
        {"id": 6, "prompt": "No sampling params here."},
    ]


# ---- through Ray Data --------------------------------------------------------------------------


def test_rows_equal_generate_and_chat(cluster, replica, model_path):
    llm = replica.llm
    rows = mixed_rows(llm)
    want = {row["id"]: expected(llm, row) for row in rows[:6]}
    assert want[4]["finish_reason"] == want[5]["finish_reason"] == "stop", (
        "the stop conditions must end their rows"
    )
    # One block: Arrow gives a column one type, and Ray Data cannot batch together blocks whose
    # ``prompt`` is text in one and token ids in the other; within one block it holds Python
    # objects.
    ds = ray.data.from_items(rows, override_num_blocks=1)
    processor = build_llm_processor(ProcessorConfig(model_path, ENGINE, batch_size=3))
    got = sorted(processor(ds).take_all(), key=lambda r: r["id"])
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    for row, out in zip(rows, got):
        if row["id"] in want:
            assert outputs_of(out) == want[row["id"]], f"row {row['id']}"
        # the input's columns are kept exactly (a struct column gives every row every key: None
        # where unset)
        assert out["prompt"] == row.get("prompt") and out["messages"] == row.get("messages"), (
            f"row {row['id']}"
        )
        params = {k: v for k, v in (out["sampling_params"] or {}).items() if v is not None}
        assert params == row.get("sampling_params", {})
        assert out["chat_template_kwargs"] == row.get("chat_template_kwargs")
    # no sampling params: the model folder's defaults (sampled, unseeded: only the length is known)
    assert (got[6]["finish_reason"], got[6]["num_generated_tokens"]) == (
        "length",
        DEFAULT_MAX_TOKENS,
    )


def test_preprocess_postprocess_and_two_engines(cluster, replica, model_path):
    """Two engines, batches of two over many blocks; preprocess makes the requests from raw rows
    (token ids as NumPy arrays, conversations), postprocess shapes the output rows."""
    questions = [
        "What is Ray?",
        "Why is the sky blue?",
        "Count to three.",
        "Name a colour.",
        "What is a KV cache?",
        "Say hello.",
        "2 + 2 = ?",
        "Spell cat.",
    ]

    def request(i: int) -> dict:
        if i % 2:
            return {
                "messages": [{"role": "user", "content": questions[i]}],
                "chat_template_kwargs": {"enable_thinking": False},
                "sampling_params": greedy(3 + i),
            }
        return {"prompt": token_prompt(10 + i, 5 + i), "sampling_params": greedy(3 + i)}

    def preprocess(row: dict) -> dict:
        r = request(row["id"])
        if "prompt" in r:
            r["prompt"] = np.array(r["prompt"])
        return {**row, **r}

    def postprocess(row: dict) -> dict:
        return {
            "id": row["id"],
            "question": row["question"],
            "answer": row["generated_text"],
            "tokens": row["generated_tokens"],
            "counts": [row["num_input_tokens"], row["num_generated_tokens"]],
            "reason": row["finish_reason"],
        }

    ds = ray.data.from_items([{"id": i, "question": q} for i, q in enumerate(questions)])
    processor = build_llm_processor(
        ProcessorConfig(model_path, ENGINE, concurrency=2, batch_size=2),
        preprocess=preprocess,
        postprocess=postprocess,
    )
    got = sorted(processor(ds).take_all(), key=lambda r: r["id"])
    assert [r["id"] for r in got] == list(range(len(questions)))
    for i, out in enumerate(got):
        want = expected(replica.llm, request(i))
        assert set(out) == {"id", "question", "answer", "tokens", "counts", "reason"}
        assert out["question"] == questions[i]
        assert (out["answer"], out["tokens"], out["counts"], out["reason"]) == (
            want["generated_text"],
            want["generated_tokens"],
            [want["num_input_tokens"], want["num_generated_tokens"]],
            want["finish_reason"],
        ), f"row {i}"


def test_bad_row_through_ray_is_a_clear_error(cluster, model_path):
    rows = [
        {"id": 0, "prompt": "fine", "sampling_params": greedy(2)},
        {"id": 41, "prompt": "both", "messages": CHAT, "sampling_params": greedy(2)},
    ]
    processor = build_llm_processor(ProcessorConfig(model_path, ENGINE))
    with pytest.raises(
        Exception
    ) as info:  # Ray wraps the engine's error; its text reaches the user
        processor(ray.data.from_items(rows, override_num_blocks=1)).take_all()
    message = str(info.value)
    assert "ValueError: nanovllm.ray: row {'id': 41, 'prompt': 'both', " in message
    assert "a row needs one of 'prompt' and 'messages'; it has both" in message


# ---- one engine replica in this process: batches as Arrow tables -----------------------------


def test_replica_keeps_columns_and_types(replica):
    """The input's columns come back unchanged (types included); the output columns have fixed
    Arrow types and replace columns of those names that the input had."""
    seeded = {
        "temperature": None,
        "max_tokens": 4,
        "seed": 9,
    }  # None: Arrow's filling for a key another row has
    batch = pa.Table.from_pylist(
        [
            {
                "id": 7,
                "prompt": token_prompt(5, 6),
                "sampling_params": greedy(3),
                "generated_text": "old",
            },
            {
                "id": 8,
                "prompt": token_prompt(6, 4),
                "sampling_params": seeded,
                "generated_text": None,
            },
        ]
    )
    out = replica(batch)
    assert out.column_names == batch.column_names + [
        c for c in OUTPUT_COLUMNS if c != "generated_text"
    ]
    inputs = [c for c in batch.column_names if c != "generated_text"]
    assert out.select(inputs).equals(batch.select(inputs))
    assert out.schema.field("generated_tokens").type == pa.list_(pa.int64())
    assert (
        out.schema.field("num_input_tokens").type
        == out.schema.field("num_generated_tokens").type
        == pa.int64()
    )
    rows = out.to_pylist()
    assert outputs_of(rows[0]) == expected(
        replica.llm, {"prompt": token_prompt(5, 6), "sampling_params": greedy(3)}
    )
    # temperature None is left out: the default (0.6) holds, seeded
    want = expected(
        replica.llm, {"prompt": token_prompt(6, 4), "sampling_params": {"max_tokens": 4, "seed": 9}}
    )
    assert outputs_of(rows[1]) == want


@pytest.mark.parametrize(
    "row, error, text",
    [
        pytest.param({"sampling_params": greedy(2)}, ValueError, "it has neither", id="neither"),
        pytest.param({"prompt": "x", "messages": CHAT}, ValueError, "it has both", id="both"),
        pytest.param(
            {"prompt": 5},
            TypeError,
            "'prompt': a prompt must be a str or a 1-D sequence",
            id="prompt-int",
        ),
        pytest.param(
            {"prompt": ""}, ValueError, "'prompt': the prompt is empty", id="prompt-empty"
        ),
        pytest.param(
            {"prompt": [1, 10**7]},
            ValueError,
            "'prompt': token 1 is 10000000, outside the vocabulary",
            id="token-outside-vocab",
        ),
        pytest.param(
            {"prompt": token_prompt(7, 300)},
            ValueError,
            "'prompt': the prompt has 300 tokens; max_model_len=256",
            id="prompt-too-long",
        ),
        pytest.param(
            {"messages": "hi"}, TypeError, "'messages' must be a non-empty list", id="messages-str"
        ),
        pytest.param(
            {"messages": [{"role": "user"}]},
            TypeError,
            "'messages': a message must have str 'role' and 'content'",
            id="message-without-content",
        ),
        pytest.param(
            {"messages": CHAT, "chat_template_kwargs": "no"},
            TypeError,
            "'chat_template_kwargs' must be a dict",
            id="template-kwargs-str",
        ),
        pytest.param(
            {"prompt": "x", "sampling_params": "greedy"},
            TypeError,
            "'sampling_params' must be a dict",
            id="params-str",
        ),
        pytest.param(
            {"prompt": "x", "sampling_params": {"temprature": 0}},
            TypeError,
            "'sampling_params' holds 'temprature', which is not a SamplingParams field",
            id="params-unknown",
        ),
        pytest.param(
            {"prompt": "x", "sampling_params": {"temperature": -1.0}},
            ValueError,
            "'sampling_params': SamplingParams.temperature must be a finite number >= 0",
            id="params-bad-value",
        ),
        pytest.param(
            {"prompt": "x", "sampling_params": {"max_tokens": "8"}},
            TypeError,
            "'sampling_params': SamplingParams.max_tokens must be an int",
            id="params-bad-type",
        ),
        pytest.param(
            {"prompt": "x", "sampling_params": {"n": 2}},
            ValueError,
            "n must be 1 (one output row per input row)",
            id="params-n",
        ),
    ],
)
def test_bad_row_is_named_and_nothing_runs(replica, row, error, text):
    """A bad row fails its batch, naming the row (its columns) and the field; the batch's good row
    is not queued."""
    # a good row first, with columns that Arrow can join with the bad row's
    good = (
        {"id": 0, "prompt": "A good row."}
        if isinstance(row.get("prompt", ""), str)
        else {"id": 0, "messages": CHAT}
    )
    batch = pa.concat_tables(
        [pa.Table.from_pylist([good]), pa.Table.from_pylist([{"id": 3, **row}])],
        promote_options="default",
    )
    with pytest.raises(error, match=r"^nanovllm\.ray: row \{'id': 3, ") as info:
        replica(batch)
    assert text in str(info.value)
    assert replica.llm.is_finished() and replica.llm.get_stats()["num_requests_waiting"] == 0


def test_prompt_column_holds_the_prompt_text(replica):
    """A conversation's row gets its rendered chat prompt in ``prompt`` (the template's text,
    which tokenizes to the prompt token ids); a text prompt keeps its text."""
    llm = replica.llm
    rendered = llm.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    rows = [{"messages": CHAT, "sampling_params": greedy(2)}]
    out = replica(pa.Table.from_pylist(rows)).to_pylist()
    assert out[0]["prompt"] == rendered and "<|im_start|>user" in rendered
    assert out[0]["num_input_tokens"] == len(llm.tokenizer.encode(rendered))
    rows = [
        {"prompt": "Plain text.", "messages": None, "sampling_params": greedy(2)},
        {"prompt": None, "messages": OTHER_CHAT, "sampling_params": greedy(2)},
    ]
    out = replica(pa.Table.from_pylist(rows)).to_pylist()
    other = llm.tokenizer.apply_chat_template(
        OTHER_CHAT, tokenize=False, add_generation_prompt=True
    )
    assert [o["prompt"] for o in out] == ["Plain text.", other]
