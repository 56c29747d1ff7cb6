"""``update_weights`` and ``reset_prefix_cache`` on the CPU (float32): after an update with a second
checkpoint's tensors (another seed, the same shape) an engine gives the greedy tokens of an engine
loaded from that checkpoint, for Qwen3 (tied and untied), Qwen3-MoE and Llama, on one rank and two
(gloo), and through two data-parallel replicas; the prefix cache filled before the update serves
nothing after it. Tensors in bfloat16, from a generator, from a transformers model's
``state_dict()``, or a subset; bad ones change nothing; an engine with requests queued refuses."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers
from hf_reference import VOCAB_SIZE, random_prompts
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from nanovllm.utils.checkpoint import make_random_checkpoint

TINY = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=VOCAB_SIZE + 1,
)
FAMILIES = {
    "qwen3_tied": dict(shape="tiny", tie_word_embeddings=True),
    "qwen3_untied": dict(shape="tiny", tie_word_embeddings=False),
    "qwen3_moe": dict(
        shape="qwen3-30b-a3b",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),  # layer 0 sparse, layer 1 dense
    "llama": dict(shape="llama3.2-1b", tie_word_embeddings=True),
}
CPU = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
PROMPTS = random_prompts(5, [40, 7, 20, 33])
HITS = [32, 0, 16, 32]  # prompt tokens the prefix cache serves when PROMPTS run again
COLD = [0] * len(PROMPTS)
GREEDY = SamplingParams(temperature=0, max_tokens=6)
FUSED = re.compile(r"^(.*)\.(q|k|v|gate|up)_proj\.weight$")
EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def build(root, family: str, seed: int) -> str:
    variant = dict(FAMILIES[family])
    return make_random_checkpoint(
        str(root / f"{family}-{seed}"),
        variant.pop("shape"),
        dtype=torch.float32,
        seed=seed,
        std=0.3,
        **(TINY | variant),
    )


def tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def as_params(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a one-rank model's parameters hold once it has loaded ``weights`` (a whole checkpoint,
    per-expert names): q/k/v and gate/up concatenated, each layer's experts stacked."""
    parts: dict[str, dict] = {}
    for name, t in weights.items():
        if m := EXPERT.match(name):
            target = m[1] + (".down_proj" if m[3] == "down" else ".gate_up_proj")
            parts.setdefault(target, {})[int(m[2]), m[3]] = t
        elif m := FUSED.match(name):
            target = m[1] + (".qkv_proj.weight" if m[2] in "qkv" else ".gate_up_proj.weight")
            parts.setdefault(target, {})[m[2]] = t
        else:
            parts[name] = {None: t}
    out = {}
    for target, p in parts.items():
        if None in p:
            out[target] = p[None]
        elif "q" in p:
            out[target] = torch.cat([p["q"], p["k"], p["v"]])
        elif "gate" in p:
            out[target] = torch.cat([p["gate"], p["up"]])
        else:
            experts = range(1 + max(e for e, _ in p))
            out[target] = torch.stack(
                [
                    p[e, "down"]
                    if target.endswith("down_proj")
                    else torch.cat([p[e, "gate"], p[e, "up"]])
                    for e in experts
                ]
            )
    return out


def generate(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Greedy completions of PROMPTS, and how many prompt tokens the prefix cache served each."""
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o["token_ids"] for o in outputs], [o["num_cached_tokens"] for o in outputs]


def assert_params(llm: LLM, want: dict[str, torch.Tensor]) -> None:
    """Rank 0's parameters are exactly ``want`` (``as_params``' names)."""
    got = dict(llm.core.executor.runner.model.named_parameters())
    assert sorted(got) == sorted(want)
    assert [k for k in got if not torch.equal(got[k], want[k])] == []


class Family:
    """A family's two checkpoints (seeds 1 and 2), an engine on each, and their greedy outputs."""

    def __init__(self, root, name: str):
        self.name = name
        self.a, self.b = build(root, name, 1), build(root, name, 2)
        self.llm_a, self.llm_b = LLM(self.a, **CPU), LLM(self.b, **CPU)
        self.out_a, _ = generate(self.llm_a)
        self.out_b, _ = generate(self.llm_b)
        assert self.out_a != self.out_b, "the two checkpoints should disagree"

    def exit(self) -> None:
        self.llm_a.exit()
        self.llm_b.exit()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    fam = Family(tmp_path_factory.mktemp("update-weights"), request.param)
    yield fam
    fam.exit()


@pytest.fixture(scope="module")
def tp2(family):
    """The family's checkpoint A on two CPU ranks."""
    llm = LLM(family.a, tensor_parallel_size=2, **CPU)
    yield llm
    llm.exit()


def check_update(llm: LLM, weights, want: list[list[int]], again: bool = True) -> None:
    """With the prefix cache warm (PROMPTS served from it), the update; then no stale hit and
    ``want``'s tokens, and (``again``) then the new KV served from the cache."""
    generate(llm)
    assert generate(llm)[1] == HITS
    llm.update_weights(weights)
    assert generate(llm) == (want, COLD)
    if again:
        assert generate(llm) == (want, HITS)


def test_update_gives_the_second_checkpoints_tokens(family):
    """Both ways: the engine on A takes B's tensors from a generator, the engine on B takes A's as
    a dict; each then holds exactly the other checkpoint's weights."""
    check_update(family.llm_a, ((name, t) for name, t in tensors(family.b).items()), family.out_b)
    check_update(family.llm_b, tensors(family.a), family.out_a)
    assert_params(family.llm_a, as_params(tensors(family.b)))
    family.llm_a.update_weights(tensors(family.a))  # as they were
    family.llm_b.update_weights(tensors(family.b))


def test_update_from_a_transformers_state_dict(family, hf_ref):
    """A trainer's ``model.state_dict().items()``: transformers' names (a tied head under
    ``lm_head.weight`` too, Qwen3-MoE's experts fused as transformers 5 holds them)."""
    state = hf_ref.model(family.b).state_dict()
    if family.name == "qwen3_moe":
        fused = "model.layers.0.mlp.experts.gate_up_proj" in state
        assert fused == (int(transformers.__version__.split(".")[0]) >= 5)
    assert "lm_head.weight" in state  # a tied head under both names
    check_update(family.llm_a, state.items(), family.out_b)
    assert_params(family.llm_a, as_params(tensors(family.b)))
    family.llm_a.update_weights(tensors(family.a))


def test_bfloat16_tensors_land_as_their_values(family):
    """bfloat16 tensors (B's, rounded) in the float32 model: every parameter holds them exactly."""
    b = {name: t.to(torch.bfloat16) for name, t in tensors(family.b).items()}
    family.llm_a.update_weights((name, t) for name, t in b.items())
    assert_params(family.llm_a, as_params({name: t.float() for name, t in b.items()}))
    family.llm_a.update_weights(tensors(family.a))


def test_a_subset_updates_only_those_tensors(family):
    """Only layer 0's MLP (Qwen3-MoE: its router and experts): those parameters take B's values,
    every other keeps A's."""
    subset = {
        name: t for name, t in tensors(family.b).items() if name.startswith("model.layers.0.mlp.")
    }
    assert len(subset) == (1 + 3 * 4 if family.name == "qwen3_moe" else 3)
    family.llm_a.update_weights(subset.items())
    assert_params(family.llm_a, as_params(tensors(family.a) | subset))
    assert generate(family.llm_a)[0] != family.out_a
    family.llm_a.update_weights(tensors(family.a))


def test_tp2_update_gives_the_second_checkpoints_tokens(family, tp2):
    """Rank 0 checks, the plan goes through the control channel and each tensor by a broadcast;
    each rank loads its shard (q/k/v heads, gate/up and expert slices, the vocabulary). bfloat16
    tensors give the tokens they give on one rank."""
    check_update(tp2, (item for item in tensors(family.b).items()), family.out_b, again=False)
    bf16 = {name: t.to(torch.bfloat16) for name, t in tensors(family.a).items()}
    family.llm_b.update_weights(bf16)
    tp2.update_weights(bf16)
    assert generate(tp2) == generate(family.llm_b)
    family.llm_b.update_weights(tensors(family.b))
    tp2.update_weights(tensors(family.a))  # the next test checks A's tokens


BAD = {
    "unknown name": (
        [("model.layers.0.mlp.gate.weight2", torch.zeros(4, 64))],
        ValueError,
        r"'model\.layers\.0\.mlp\.gate\.weight2'.* no matching model parameter",
    ),
    "wrong shape": (
        [("model.layers.1.self_attn.o_proj.weight", torch.zeros(64, 64))],
        ValueError,
        r"'model\.layers\.1\.self_attn\.o_proj\.weight'.*shape \(64, 64\).*"
        r"config\.json implies \(64, 128\)",
    ),
    "not a tensor": (
        [("model.norm.weight", [1.0] * 64)],
        TypeError,
        r"'model\.norm\.weight' must be a torch\.Tensor, got list",
    ),
    "integer tensor": (
        [("model.norm.weight", torch.ones(64, dtype=torch.int64))],
        TypeError,
        r"'model\.norm\.weight' must be a floating-point tensor, got torch\.int64",
    ),
    "not a pair": (
        [("model.norm.weight",)],
        TypeError,
        r"weights\[1\] must be a \(name, tensor\) pair",
    ),
}


UNCOPYABLE = {
    "meta tensor": (
        torch.zeros(64, device="meta"),
        ValueError,
        r"'model\.norm\.weight' is on the meta device",
    ),
    "sparse tensor": (
        torch.zeros(64).to_sparse(),
        TypeError,
        r"'model\.norm\.weight' must be a dense \(strided\) tensor, got torch\.sparse_coo",
    ),
}


def test_uncopyable_tensors_after_good_ones_change_nothing(family, tp2, dp):
    """A whole checkpoint's good tensors, then one that passes the name, shape and dtype checks but
    holds no copyable data: refused before any is written, on one rank, two and two replicas; each
    engine then gives its own greedy tokens and takes a good update (no rank left waiting)."""
    engines = [family.llm_a, tp2] + ([dp] if dp is not None else [])
    for llm in engines:
        assert generate(llm)[0] == family.out_a
        for tensor, error, message in UNCOPYABLE.values():
            with pytest.raises(error, match=message):
                llm.update_weights([*tensors(family.b).items(), ("model.norm.weight", tensor)])
            assert generate(llm)[0] == family.out_a
    assert_params(family.llm_a, as_params(tensors(family.a)))
    for llm in engines:
        llm.update_weights(tensors(family.b))
        assert generate(llm) == (family.out_b, COLD)
        llm.update_weights(tensors(family.a))


def test_bad_tensors_change_nothing(family, tp2):
    """A good tensor first, then a bad one: refused before anything is written, on one rank and
    two; the engines keep their weights and prefix caches and go on serving."""
    for llm in (family.llm_a, tp2):
        assert generate(llm) == (family.out_a, COLD)  # and the prefix cache warm
        for bad, error, message in BAD.values():
            with pytest.raises(error, match=message):
                llm.update_weights(iter([("model.norm.weight", torch.zeros(64)), *bad]))
        assert generate(llm) == (family.out_a, HITS)
    assert_params(family.llm_a, as_params(tensors(family.a)))


def test_refused_while_a_request_is_queued_or_running(family, tp2):
    """A RuntimeError that leaves the request to finish as it would have; then the update goes."""
    for llm in (family.llm_a, tp2):
        request_id = llm.add_request(PROMPTS[0], GREEDY)
        with pytest.raises(
            RuntimeError,
            match=r"needs an idle engine, but sequences are queued \(running 0, waiting 1",
        ):
            llm.update_weights(tensors(family.b))
        llm.step()
        with pytest.raises(
            RuntimeError,
            match=r"needs an idle engine, but sequences are queued \(running 1, waiting 0",
        ):
            llm.update_weights(tensors(family.b))
        finished = {}
        while not llm.is_finished():
            finished.update(llm.step()[0])
        assert finished == {request_id: family.out_a[0]}
        llm.update_weights(tensors(family.b))
        assert generate(llm) == (family.out_b, COLD)
        llm.update_weights(tensors(family.a))


def test_reset_prefix_cache(family):
    """A repeated prompt is served from the cache, and after the reset it is not."""
    llm = family.llm_a
    generate(llm)
    assert generate(llm) == (family.out_a, HITS)
    assert llm.reset_prefix_cache() is True
    assert generate(llm) == (family.out_a, COLD)
    assert generate(llm) == (family.out_a, HITS)


@pytest.fixture(scope="module")
def dp(family):
    """The family's checkpoint A on two data-parallel replicas (processes of this host); None but
    for one family (one through the replicas is enough)."""
    if family.name != "qwen3_tied":
        yield None
        return
    llm = LLM(family.a, data_parallel_size=2, **CPU)
    yield llm
    llm.exit()


def test_data_parallel_replicas_all_take_the_update(family, dp):
    """Both replicas serve (and cache) the prompts; after the update each gives B's tokens with no
    stale hit; bad tensors change no replica; a queued request refuses the update;
    ``reset_prefix_cache`` reaches every replica."""
    if dp is None:
        pytest.skip("one family through the replicas is enough")
    check_update(dp, (item for item in tensors(family.b).items()), family.out_b)
    assert all(r["generation_tokens"] > 0 for r in dp.get_stats()["replicas"])
    bad, error, message = BAD["wrong shape"]
    with pytest.raises(error, match=message):
        dp.update_weights([("model.norm.weight", torch.zeros(64)), *bad])
    assert generate(dp) == (family.out_b, HITS)
    request_id = dp.add_request(PROMPTS[1], GREEDY)
    with pytest.raises(RuntimeError, match=r"needs an idle engine"):
        dp.update_weights(tensors(family.a))
    assert dp.abort_request(request_id)
    assert dp.reset_prefix_cache() is True
    assert generate(dp) == (family.out_b, COLD)
    dp.update_weights(tensors(family.a))
    assert generate(dp) == (family.out_a, COLD)


class _FailsToMove(torch.Tensor):
    """A tensor whose ``to`` fails: a failure inside rank 0's load, after the checks."""

    def to(self, *args, **kwargs):
        raise RuntimeError("this tensor cannot move")


def test_a_failure_in_rank_zeros_load_leaves_no_worker_waiting(family, tp2):
    """Rank 0 fails while it loads (after every check): the error reaches the caller, and the next
    update and ``generate`` run on every rank (no worker left in a broadcast)."""
    failing = torch.zeros(64).as_subclass(_FailsToMove)
    with pytest.raises(RuntimeError, match="this tensor cannot move"):
        tp2.update_weights([*tensors(family.b).items(), ("model.norm.weight", failing)])
    tp2.update_weights(tensors(family.b))
    assert generate(tp2) == (family.out_b, COLD)
    tp2.update_weights(tensors(family.a))
    assert generate(tp2) == (family.out_a, COLD)


CTRL_C = """
import json, os, signal, sys, threading, time
from safetensors.torch import load_file
from nanovllm import LLM, SamplingParams
from nanovllm.features import weight_update

load_rank = weight_update.load_rank

def slow_load(runner, *args):  # one tensor a call, each a while: presses land between calls
    time.sleep(0.02)
    return load_rank(runner, *args)

def ctrl_c(started, delays):  # as a terminal does: SIGINT to every process of the group
    started.wait()
    for delay in delays:
        time.sleep(delay)
        os.killpg(os.getpgid(0), signal.SIGINT)

if __name__ == "__main__":
    weight_update.UPDATE_BATCH = 1
    weight_update.load_rank = slow_load
    a, b, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(a, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256,
              **kwargs)
    weights = {p: load_file(os.path.join(p, "model.safetensors")) for p in (a, b)}
    prompts = [[1 + i, 2, 3] * 5 for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    def run():
        return [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    out = {a: run()}
    llm.update_weights(weights[b])
    out[b] = run()
    result = {"distinct": out[a] != out[b], "interrupted": [], "served": []}
    now = b
    for delays in ([0.05], [0.15], [0.1, 0.05], [0.2, 0.0]):  # once, then twice
        target = a if now == b else b
        started = threading.Event()
        threading.Thread(target=ctrl_c, args=(started, delays), daemon=True).start()
        try:
            started.set()
            llm.update_weights(weights[target])
            time.sleep(1.0)  # the presses come within it
            result["interrupted"].append(False)
        except KeyboardInterrupt:
            result["interrupted"].append(True)
        try:
            time.sleep(0.5)  # a second press held until the update's end
        except KeyboardInterrupt:
            pass
        tokens = run()
        result["served"].append("new" if tokens == out[target] else
                                "old" if tokens == out[now] else "mixed")
        now = target if tokens == out[target] else now
        llm.update_weights(weights[now])  # every rank takes a whole update after it
        result["served"][-1] += "+" + ("ok" if run() == out[now] else "wrong")
    llm.exit()
    print(json.dumps(result))
"""


@pytest.mark.parametrize("parallel", ["tp2", "dp2"])
def test_ctrl_c_during_an_update(family, parallel, tmp_path):
    """Ctrl-C, once or twice, while ``update_weights`` runs on two ranks or two replicas: every
    rank and replica ends on one checkpoint's weights whole (the update goes through), and the
    engine serves its greedy tokens and takes the next update; nothing is leaked at exit."""
    if family.name != "qwen3_tied":
        pytest.skip("one family is enough")
    kwargs = {"tp2": dict(tensor_parallel_size=2), "dp2": dict(data_parallel_size=2)}[parallel]
    script = tmp_path / "ctrl_c_update.py"
    script.write_text(CTRL_C)
    proc = subprocess.run(
        [sys.executable, str(script), family.a, family.b, json.dumps(kwargs)],
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["distinct"]
    assert result["interrupted"] == [True] * 4
    assert result["served"] == ["new+ok"] * 4
