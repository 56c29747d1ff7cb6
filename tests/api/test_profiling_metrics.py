"""Profiling, metrics and the tokenizer on the CPU: ``start_profile``/``stop_profile`` write a torch
profiler trace named by rank with the model's ops in it; ``get_metrics`` gives vLLM's metric objects
whose values are ``get_stats``' after a known workload (exact token counts); bad settings raise."""

import gzip
import json
import os
from types import SimpleNamespace

import pytest
from api_helpers import greedy, make_llm

from nanovllm.v1.metrics.reader import Counter, Gauge, Histogram, Metric, Vector

PROMPTS = [list(range(1, 41)), list(range(1, 33)) + [50, 51, 52], [7, 8, 9]]
MAX_TOKENS = 5


def events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_profile_writes_a_trace_per_rank(ckpt_tied, tmp_path):
    where = tmp_path / "traces"
    config = {"profiler": "torch", "torch_profiler_dir": str(where)}
    with make_llm(ckpt_tied.path, profiler_config=config) as llm:
        llm.start_profile()
        want = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
        llm.stop_profile()
        llm.stop_profile()  # not running: nothing happens
        # the key-averages table is skipped (with a warning) when torch cannot parse an event
        # name, which happens now and then; the trace is always written
        assert "trace_tp0.pt.trace.json.gz" in os.listdir(where)
        assert set(os.listdir(where)) <= {
            "trace_tp0.profiler_out.txt",
            "trace_tp0.pt.trace.json.gz",
        }
        names = {e.get("name") for e in events(str(where / "trace_tp0.pt.trace.json.gz"))}
        assert {"aten::embedding", "aten::linear", "aten::softmax"} & names
        assert any(n.startswith("aten::") for n in names if n)
        llm.start_profile("run2")
        got = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
        llm.stop_profile()
        assert os.path.isfile(where / "run2_tp0.pt.trace.json.gz")
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        with pytest.raises(ValueError, match=r"profile_prefix must be .*, got '\.bad'"):
            llm.start_profile(".bad")
        with pytest.raises(ValueError, match=r"delay_iterations must be None or 0 here, got 3"):
            llm.start_profile(delay_iterations=3)


def test_profiler_config_values(ckpt_tied, tmp_path):
    """A ProfilerConfig-like object works; without a profiler, or with bad settings, start_profile
    raises (naming the key, the value and what is allowed) and the engine keeps serving."""
    obj = SimpleNamespace(profiler="torch", torch_profiler_dir=str(tmp_path / "o"))
    obj.torch_profiler_use_gzip = False
    with make_llm(ckpt_tied.path, profiler_config=obj) as llm:
        llm.start_profile()
        llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)
        llm.stop_profile()
        with open(tmp_path / "o" / "trace_tp0.pt.trace.json") as f:
            assert json.load(f)["traceEvents"]
    with make_llm(ckpt_tied.path) as llm:
        with pytest.raises(RuntimeError, match=r"profiling is not enabled: create the LLM with"):
            llm.start_profile()
        assert llm.generate([[1, 2]], greedy(2), use_tqdm=False)[0].outputs[0].token_ids
    bad = [
        ({"profiler": "cuda", "torch_profiler_dir": "x"}, r"\['profiler'\] must be 'torch' or"),
        ({"profiler": "torch"}, r"\['torch_profiler_dir'\] must be a local directory"),
        ({"profiler": "torch", "torch_profiler_dir": "x", "nope": 1}, r"unknown key 'nope'"),
        (
            {"profiler": "torch", "torch_profiler_dir": "x", "torch_profiler_activities": ["GPU"]},
            r"\['torch_profiler_activities'\] must be None or a list of 'CPU', 'CUDA'",
        ),
        (
            {"profiler": "torch", "torch_profiler_dir": "x", "max_iterations": 2},
            r"\['max_iterations'\] must be 0 \(the only value supported here\), got 2",
        ),
    ]
    for config, message in bad:
        with make_llm(ckpt_tied.path, profiler_config=config) as llm:
            with pytest.raises(ValueError, match=message):
                llm.start_profile()


def test_metrics_equal_get_stats(ckpt_tied):
    with make_llm(ckpt_tied.path) as llm:
        assert llm.get_tokenizer() is llm.tokenizer
        outputs = llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
        outputs += llm.generate(PROMPTS[:1], greedy(MAX_TOKENS), use_tqdm=False)  # 32 cached
        stats = llm.get_stats()
        metrics = llm.get_metrics()
    assert all(isinstance(m, Metric) and not isinstance(m, (Histogram, Vector)) for m in metrics)
    by_name = {m.name: m for m in metrics if m.labels.get("sleep_state") in (None, "awake")}
    assert all(m.labels["model_name"] == ckpt_tied.path for m in metrics)
    prompt_tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS[0])
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == MAX_TOKENS * 4 == stats["generation_tokens"]
    assert stats["prefix_cache_hits"] == 32  # the first prompt again: its two full blocks
    want = {
        "vllm:prompt_tokens": (Counter, prompt_tokens),
        "vllm:prompt_tokens_cached": (Counter, 32),
        "vllm:generation_tokens": (Counter, generated),
        "vllm:prefix_cache_queries": (Counter, stats["prefix_cache_queries"]),
        "vllm:prefix_cache_hits": (Counter, stats["prefix_cache_hits"]),
        "vllm:num_preemptions": (Counter, 0),
        "vllm:num_requests_running": (Gauge, 0.0),
        "vllm:num_requests_waiting": (Gauge, 0.0),
        "vllm:kv_cache_usage_perc": (Gauge, 0.0),
        "vllm:engine_sleep_state": (Gauge, 1.0),
        "nanovllm:prefill_throughput": (Gauge, stats["prefill_throughput"]),
        "nanovllm:decode_throughput": (Gauge, stats["decode_throughput"]),
    }
    assert {name: (type(m), m.value) for name, m in by_name.items()} == want
    assert prompt_tokens == stats["prompt_tokens"] + stats["prefix_cache_hits"]
    assert by_name["vllm:prompt_tokens"].labels == {"model_name": ckpt_tied.path, "engine": "0"}
