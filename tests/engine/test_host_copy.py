"""``runner/host_copy.copy_words`` under the Triton interpreter (this file run as a script): the
first ``nbytes`` bytes exactly, whatever the element types, nothing past them; whole words only."""

import pytest
import torch
from triton_interpreter import results_under_interpreter, run_cases


def check_copy(nbytes: int) -> dict:
    from nanovllm.runner.host_copy import copy_words

    src = torch.arange(3000, dtype=torch.int64) * 7919  # 24,000 bytes
    dst = torch.full((6000,), -1, dtype=torch.int32)
    copy_words(src, dst, nbytes)
    got, want = dst.view(torch.uint8), src.view(torch.uint8)
    return {
        "copied": bool(torch.equal(got[:nbytes], want[:nbytes])),
        "rest_kept": bool((dst.view(torch.uint8)[nbytes:] == 255).all()),
    }


def check_refused(nbytes: int) -> dict:
    from nanovllm.runner.host_copy import copy_words

    try:
        copy_words(torch.zeros(4, dtype=torch.int64), torch.zeros(8, dtype=torch.int32), nbytes)
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


CASES = {
    "one_word": (check_copy, 4),
    "one_program_and_a_word": (check_copy, 4 * 1025),  # past one program's block
    "int64_rows": (check_copy, 8 * 2999),
    "nothing": (check_copy, 0),
    "part_word": (check_refused, 6),
    "past_the_end": (check_refused, 36),
}


def run_interpreter_cases() -> dict:
    return run_cases(CASES, lambda case: case[0](case[1]))


@pytest.fixture(scope="module")
def results() -> dict:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_copy_words(results, case):
    r = results[case]
    assert "error" not in r, r["error"]
    if CASES[case][0] is check_refused:
        refused = r["refused"]
        assert refused and "4-byte words" in refused and str(CASES[case][1]) in refused
    else:
        assert r == {"copied": True, "rest_kept": True}


if __name__ == "__main__":
    import json

    print(json.dumps(run_interpreter_cases()))
