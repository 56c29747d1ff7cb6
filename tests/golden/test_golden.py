"""Greedy (and seeded) outputs on the CPU equal those recorded in ``tiny_outputs.json``, token for
token: chunked prefill, preemption, prefix hits, n > 1, stop strings, logprobs, max_model_len, and
two tensor-parallel ranks. The file was written by ``cases.py`` before the engine was
re-structured into a front end, an engine core and workers, so it pins every behaviour across it.
The seeded completions were recorded again when the CPU's plain temperature draw became the
inverse-CDF draw (``sampling.torch_ops.cdf_draw``); every greedy output is the original."""

import json

import pytest

from golden.cases import GOLDEN_FILE, run_checkpoint

LOGPROB_TOLERANCE = 2e-4  # the file rounds to 4 decimals; float32 sums differ by rank count


@pytest.fixture(scope="module")
def golden() -> dict:
    with open(GOLDEN_FILE) as f:
        return json.load(f)


def assert_same(got: dict, want: dict, what: str) -> None:
    for workload, outs in want.items():
        assert len(got[workload]) == len(outs), what
        for i, (g, w) in enumerate(zip(got[workload], outs)):
            where = f"{what}, {workload}, prompt {i}"
            assert g["num_cached_tokens"] == w["num_cached_tokens"], where
            for k, (gc, wc) in enumerate(zip(g["outputs"], w["outputs"], strict=True)):
                for key in ("token_ids", "text", "finish_reason", "stop_reason"):
                    assert gc[key] == wc[key], f"{where}, completion {k}: {key}"
                if wc["logprobs"] is None:
                    assert gc["logprobs"] is None, where
                    continue
                for got_entry, want_entry in zip(gc["logprobs"], wc["logprobs"], strict=True):
                    assert [t for t, _ in got_entry] == [t for t, _ in want_entry], where
                    assert [v for _, v in got_entry] == pytest.approx(
                        [v for _, v in want_entry], abs=LOGPROB_TOLERANCE
                    )


# the untied checkpoint over two ranks is checked against transformers by
# tests/engine/test_tensor_parallel.py::test_tp2_matches_tp1_and_transformers
@pytest.mark.parametrize("ckpt_name,tp", [("ckpt_tied", 1), ("ckpt_tied", 2), ("ckpt_untied", 1)])
def test_outputs_equal_the_golden_file(ckpt_name, tp, request, golden):
    want = golden[f"{ckpt_name.removeprefix('ckpt_')}/tp{tp}"]
    stops = {int(i): s for i, s in want["stops"].items()}
    got = run_checkpoint(request.getfixturevalue(ckpt_name).path, tp, stops)
    assert_same(got["results"], want["results"], f"{ckpt_name}, tp={tp}")
