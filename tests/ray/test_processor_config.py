"""``nanovllm.ray``'s configuration: ``ProcessorConfig`` and ray.data.llm's
``vLLMEngineProcessorConfig``, ``build_llm_processor``'s argument checks, and Ray loaded only when
used. Nothing here starts an engine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.data", reason="the ray extra is not installed (pip install -e '.[ray]')")

from nanovllm.ray import ProcessorConfig, build_llm_processor  # noqa: E402
from nanovllm.ray.processor_config import vLLMEngineProcessorConfig  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def model_path(tmp_path) -> str:
    return str(tmp_path)  # configurations name a folder; no engine reads it here


# ---- configuration and imports ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        pytest.param(
            {"model_source": 5},
            TypeError,
            "ProcessorConfig.model_source must be the path",
            id="model-int",
        ),
        pytest.param(
            {"model_source": ""},
            ValueError,
            "ProcessorConfig.model_source must be the path",
            id="model-empty",
        ),
        pytest.param(
            {"engine_kwargs": [("device", "cpu")]},
            TypeError,
            "ProcessorConfig.engine_kwargs must be a dict",
            id="engine-kwargs-list",
        ),
        pytest.param(
            {"engine_kwargs": {"model": "/m"}},
            TypeError,
            "must not hold 'model'",
            id="engine-kwargs-model",
        ),
        pytest.param(
            {"engine_kwargs": {"max_model_length": 8}},
            TypeError,
            "holds 'max_model_length', which LLM() does not accept",
            id="engine-kwargs-unknown",
        ),
        pytest.param(
            {"engine_kwargs": {"tensor_parallel_size": 0}},
            ValueError,
            "ProcessorConfig.engine_kwargs['tensor_parallel_size'] must be an int >= 1, got 0",
            id="tp-zero",
        ),
        pytest.param(
            {"engine_kwargs": {"tensor_parallel_size": "2"}},
            TypeError,
            "['tensor_parallel_size'] must be an int >= 1, got '2'",
            id="tp-str",
        ),
        pytest.param(
            {"concurrency": 0},
            ValueError,
            "ProcessorConfig.concurrency must be >= 1, got 0",
            id="concurrency-zero",
        ),
        pytest.param(
            {"concurrency": 1.5},
            TypeError,
            "ProcessorConfig.concurrency must be an int or a (min, max)",
            id="concurrency-float",
        ),
        pytest.param(
            {"concurrency": True},
            TypeError,
            "ProcessorConfig.concurrency must be an int",
            id="concurrency-bool",
        ),
        pytest.param(
            {"concurrency": (3, 2)},
            ValueError,
            "1 <= min <= max, got (3, 2)",
            id="concurrency-min-over-max",
        ),
        pytest.param(
            {"concurrency": (1, 2, 3)},
            TypeError,
            "(min, max) tuple of ints, got (1, 2, 3)",
            id="concurrency-triple",
        ),
        pytest.param(
            {"batch_size": 0},
            ValueError,
            "ProcessorConfig.batch_size must be >= 1, got 0",
            id="batch-zero",
        ),
        pytest.param(
            {"batch_size": "64"},
            TypeError,
            "ProcessorConfig.batch_size must be an int, got '64'",
            id="batch-str",
        ),
        pytest.param(
            {"num_gpus": -1},
            ValueError,
            "ProcessorConfig.num_gpus must be a finite number >= 0",
            id="gpus-negative",
        ),
        pytest.param(
            {"num_gpus": float("nan")},
            ValueError,
            "ProcessorConfig.num_gpus must be a finite number",
            id="gpus-nan",
        ),
        pytest.param(
            {"num_gpus": "1"},
            TypeError,
            "ProcessorConfig.num_gpus must be a number or None",
            id="gpus-str",
        ),
        pytest.param(
            {"num_gpus": 1, "engine_kwargs": {"tensor_parallel_size": 2}},
            ValueError,
            "num_gpus must be 0 (engines on the CPU) or at least tensor_parallel_size=2, got 1",
            id="gpus-under-tp",
        ),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, error, text):
    with pytest.raises(error) as info:
        ProcessorConfig(**{"model_source": "/models/qwen3", **kwargs})
    assert text in str(info.value)


def test_config_values():
    engine_kwargs = {"tensor_parallel_size": 2}
    config = ProcessorConfig(Path("/models/qwen3"), engine_kwargs, concurrency=(1, 3))
    engine_kwargs["device"] = "cpu"  # the config holds its own copy
    assert config.model_source == "/models/qwen3"
    assert (config.engine_kwargs, config.concurrency) == ({"tensor_parallel_size": 2}, (1, 3))
    # num_gpus None: tensor_parallel_size on a cluster with GPUs, 0 on a CPU-only one; a set
    # value as it is
    assert (config.resolved_num_gpus(8), config.resolved_num_gpus(0)) == (2, 0)
    assert ProcessorConfig("/m", num_gpus=0.5).resolved_num_gpus(8) == 0.5
    assert ProcessorConfig("/m", {"tensor_parallel_size": 2}, num_gpus=0).resolved_num_gpus(8) == 0


def test_build_llm_processor_checks_its_arguments():
    with pytest.raises(
        TypeError,
        match=r"config must be a vLLMEngineProcessorConfig \(or ProcessorConfig\), got dict",
    ):
        build_llm_processor({"model_source": "/m"})
    with pytest.raises(TypeError, match="postprocess must be a function from row"):
        build_llm_processor(ProcessorConfig("/m"), postprocess="generated_text")
    with pytest.raises(TypeError, match="the processor takes a ray.data.Dataset, got list"):
        build_llm_processor(ProcessorConfig("/m"))([{"prompt": "hi"}])


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    }
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_ray_is_imported_only_when_used():
    done = run_python(
        "import sys, nanovllm; from nanovllm import LLM, SamplingParams; print(nanovllm.__file__, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'pyarrow')))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [os.path.join(ROOT, "nanovllm", "__init__.py"), "[]"]
    missing = run_python("import sys; sys.modules['ray'] = None; import nanovllm.ray")
    assert missing.returncode != 0
    assert 'ImportError: nanovllm.ray needs Ray Data: pip install -e ".[ray]"' in missing.stderr


def test_vllm_engine_processor_config(model_path):
    """ray.data.llm's name: its fields at their defaults are accepted, other values refused;
    engine_kwargs' enable_chunked_prefill=True (always on here) is accepted and dropped."""
    config = vLLMEngineProcessorConfig(
        model_source=model_path,
        engine_kwargs={"enable_chunked_prefill": True, "max_num_batched_tokens": 4096},
        concurrency=1,
        batch_size=64,
    )
    assert isinstance(config, ProcessorConfig)
    assert config.engine_kwargs == {"max_num_batched_tokens": 4096}
    for field, value, message in (
        ("apply_chat_template", False, r"apply_chat_template must be True here, got False"),
        ("has_image", True, r"has_image must be False here, got True"),
        ("accelerator_type", "L4", r"accelerator_type must be None here, got 'L4'"),
    ):
        with pytest.raises(ValueError, match=rf"vLLMEngineProcessorConfig\.{message}"):
            vLLMEngineProcessorConfig(model_source=model_path, **{field: value})
    with pytest.raises(ValueError, match=r"\['enable_chunked_prefill'\] must be True"):
        vLLMEngineProcessorConfig(
            model_source=model_path, engine_kwargs={"enable_chunked_prefill": False}
        )
