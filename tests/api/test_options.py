"""Engine options with vLLM's meaning: ``seed`` (unseeded requests' draws, the process's own
generators, dummy weights; tensor- and data-parallel engines), ``enable_prefix_caching=False``,
``tokenizer`` (a folder of tokenizer files), ``max_logprobs``."""

import os
import random
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from api_helpers import make_llm

from nanovllm import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9] * 4, [40, 41, 42], [5, 6, 7, 8, 9] * 4]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=10)  # no seed of its own
GREEDY = SamplingParams(temperature=0, max_tokens=10)


def tokens(llm, prompts=PROMPTS, params=SAMPLED) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# ---- seed ------------------------------------------------------------------------------------


def test_unseeded_draws_follow_the_engine_seed(ckpt_tied):
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 7), ("d", None), ("e", None)):
        with make_llm(ckpt_tied.path, device="cpu", seed=seed) as llm:
            runs[name] = tokens(llm) + tokens(llm)  # the second call draws on from the first
    assert runs["a"] == runs["b"]
    assert runs["a"][0] != runs["a"][2]  # the same prompt twice in a call: two draws
    assert runs["c"] != runs["a"] and runs["d"] != runs["e"] and runs["d"] != runs["a"]


def test_dummy_weights_are_drawn_from_the_seed(ckpt_tied):
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        with make_llm(ckpt_tied.path, device="cpu", load_format="dummy", seed=seed) as llm:
            runs[name] = tokens(llm, params=GREEDY)
    assert runs["a"] == runs["b"] != runs["c"]


SCRIPT = """
import random, sys
import numpy as np
import torch
from nanovllm import LLM
if __name__ == "__main__":
    seed = None if sys.argv[2] == "None" else int(sys.argv[2])
    llm = LLM(sys.argv[1], device="cpu", kvcache_block_size=16, num_kvcache_blocks=16,
              max_model_len=64, seed=seed)
    print(random.randint(0, 10**9), int(np.random.randint(10**9)), int(torch.randint(10**9, ())))
    llm.exit()
"""


def test_the_process_generators_are_seeded(ckpt_tied, tmp_path):
    """As in vLLM's reproducibility example: ``random`` after ``LLM()`` prints the same each run."""
    script = tmp_path / "seeded.py"
    script.write_text(textwrap.dedent(SCRIPT))

    def run(seed) -> str:
        args = [sys.executable, str(script), ckpt_tied.path, str(seed)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # this checkout's package
        out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    seeded, unseeded = run(5), run(None)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)  # what any run with seed 5 prints
    want = [random.randint(0, 10**9), int(np.random.randint(10**9)), int(torch.randint(10**9, ()))]
    assert [int(x) for x in seeded] == want != [int(x) for x in unseeded]


def test_seed_is_checked(ckpt_tied):
    with pytest.raises(TypeError, match=r"Config.seed must be an int, got '1' \(str\)"):
        make_llm(ckpt_tied.path, seed="1")
    with pytest.raises(ValueError, match=r"Config.seed must be in \[0, 4294967295\], got -1"):
        make_llm(ckpt_tied.path, seed=-1)


# ---- prefix caching off ----------------------------------------------------------------------


def test_prefix_caching_off_has_no_hits_and_the_same_tokens(ckpt_tied):
    prompts = [list(range(10, 60)), list(range(10, 60)) + [3, 4]]
    results = {}
    for caching in (True, False):
        with make_llm(ckpt_tied.path, device="cpu", enable_prefix_caching=caching) as llm:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            outs += llm.generate(prompts, GREEDY, use_tqdm=False)
            stats = llm.get_stats()
            results[caching] = [o.outputs[0].token_ids for o in outs]
            cached = [o.num_cached_tokens for o in outs]
            if caching:
                assert stats["prefix_cache_hits"] > 0 and max(cached) == 48
            else:
                assert stats["prefix_cache_hits"] == 0 and cached == [0, 0, 0, 0]
    assert results[True] == results[False]


# ---- tokenizer folder ------------------------------------------------------------------------


def test_tokenizer_folder(ckpt_tied, tmp_path):
    from transformers import AutoTokenizer

    model, tok = tmp_path / "model", tmp_path / "tok"
    model.mkdir()
    tok.mkdir()
    for name in os.listdir(ckpt_tied.path):
        is_tokenizer = name.startswith("tokenizer")
        shutil.copy(os.path.join(ckpt_tied.path, name), tok if is_tokenizer else model)
    with pytest.raises(ValueError, match="has no tokenizer"):
        make_llm(str(model), device="cpu")
    reference = AutoTokenizer.from_pretrained(str(tok))
    with make_llm(str(model), device="cpu", tokenizer=str(tok)) as llm:
        out = llm.generate("a b c", GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == reference.encode("a b c")
        assert out.outputs[0].text == reference.decode(out.outputs[0].token_ids)


# ---- max_logprobs ----------------------------------------------------------------------------


def test_max_logprobs(ckpt_tied):
    with make_llm(ckpt_tied.path, device="cpu", max_logprobs=2) as llm:
        for name in ("logprobs", "prompt_logprobs"):
            too_many = SamplingParams(max_tokens=2, **{name: 3})
            with pytest.raises(ValueError, match=rf"prompts\[0\]: {name}=3 exceeds max_logprobs=2"):
                llm.generate([[1, 2, 3]], too_many, use_tqdm=False)
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)
        assert len(out[0].outputs[0].logprobs[0]) >= 2  # it keeps serving
    with make_llm(ckpt_tied.path, device="cpu", max_logprobs=-1) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=50), use_tqdm=False)
        assert len(out[0].outputs[0].logprobs[0]) >= 50
    try:
        whole = SamplingParams(max_tokens=2, logprobs=-1)
    except ValueError:
        return  # logprobs=-1 (the whole vocabulary) is not a SamplingParams value here
    with make_llm(ckpt_tied.path, device="cpu", max_logprobs=20) as llm:
        with pytest.raises(ValueError, match=r"logprobs=-1 exceeds max_logprobs=20"):
            llm.generate([[1, 2, 3]], whole, use_tqdm=False)


# ---- tensor and data parallelism -------------------------------------------------------------


def process_draw(runner) -> float:
    """The next draw of the rank's process-wide ``random`` (a ``collective_rpc`` method)."""
    return random.random()


def test_two_ranks_draw_as_one(ckpt_tied):
    runs = []
    for tp in (1, 2):
        with make_llm(ckpt_tied.path, device="cpu", tensor_parallel_size=tp, seed=3) as llm:
            runs.append(tokens(llm))
    assert runs[0] == runs[1]


def test_replicas_draw_apart_and_reproducibly(ckpt_tied):
    """Replica r's process and request draws are seeded with ``seed + r``, so a run repeats (as
    test_unseeded_draws_follow_the_engine_seed shows for one engine); one prompt twice, one to
    each replica, gives two continuations."""
    with make_llm(ckpt_tied.path, device="cpu", data_parallel_size=2, seed=4) as llm:
        assert llm.collective_rpc(process_draw) == [
            random.Random(4).random(),
            random.Random(5).random(),
        ]
        first, second = tokens(llm, [PROMPTS[0]] * 2)
    assert first != second
