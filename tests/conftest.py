"""Shared fixtures: tiny random Qwen3 checkpoints and the transformers greedy reference; and the
one place that skips the tests marked ``gpu`` without a CUDA GPU."""

import importlib.util

import pytest
from hf_reference import HFReference, TinyCheckpoint, build_checkpoint

# Qwen3.5's references need transformers >= 5.2 (its qwen3_5 models); older ones skip them
QWEN3_5_TESTS = ["models/test_qwen3_5_engine.py", "models/test_qwen3_5_model.py"]
QWEN3_5_TESTS.append("layers/test_linear_attention_ops.py")
HAS_QWEN3_5 = importlib.util.find_spec("transformers.models.qwen3_5") is not None
collect_ignore = [] if HAS_QWEN3_5 else QWEN3_5_TESTS


@pytest.fixture(scope="session")
def ckpt_tied(tmp_path_factory) -> TinyCheckpoint:
    """Tied LM head, rope theta 12345 at the top level of config.json."""
    path = str(tmp_path_factory.mktemp("qwen3-tied"))
    return build_checkpoint(
        path, seed=1, rope_theta=12345.0, rope_style="top-level", tie_word_embeddings=True
    )


@pytest.fixture(scope="session")
def ckpt_untied(tmp_path_factory) -> TinyCheckpoint:
    """Separate LM head, rope theta 5432.1 in ``rope_parameters``."""
    path = str(tmp_path_factory.mktemp("qwen3-untied"))
    return build_checkpoint(
        path, seed=2, rope_theta=5432.1, rope_style="rope_parameters", tie_word_embeddings=False
    )


@pytest.fixture(scope="session")
def hf_ref() -> HFReference:
    return HFReference()


def pytest_collection_modifyitems(config, items):
    """A test marked ``gpu`` (``python -m pytest -m gpu`` runs them all) is skipped without a CUDA
    GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
