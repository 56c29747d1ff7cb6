"""The package's shape, checked like its behaviour: what a plain request loads, import cycles,
file sizes, the share of docstrings, and ruff's format and lint."""

import ast
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "nanovllm")
# 3,500 before hybrid models (state slots, registry rows, multimodal configs) and the scheduler
# letting requests pass one that a processor holds back; one kv_layers for every "is it hybrid";
# layers/small_batch.py, where the linears, norms, activation and LM head hand a few rows on a GPU
# to their own kernels; the flag by which o_proj and down_proj leave a split few-rows GEMM's ranges
# to the norm behind; the decode graphs copying their inputs in and their tokens out themselves
PLAIN_PATH_LINES = 3607
FEATURES = (
    "nanovllm.features",
    "nanovllm.quantization",
    "nanovllm.layers.moe",
    "nanovllm.parallel.data_parallel",
    "nanovllm.parallel.replica",
    "nanovllm.parallel.custom_all_reduce",
    "nanovllm.parallel.workers",
    "nanovllm.parallel.control_channel",
    "nanovllm.parallel.group",
    "nanovllm.parallel.reduce_norm",
    "nanovllm.runner.multiproc_executor",
    "nanovllm.ray",
    "nanovllm.utils.weights",
    "nanovllm.utils.float8",
    "nanovllm.sampling.extras",
    "nanovllm.lora",
    "nanovllm.models.qwen3_5",
    "nanovllm.layers.linear_attention",
    "nanovllm.engine.state_slots",
    "nanovllm.runner.state_runner",
)

PLAIN_GENERATE = """
import json, sys
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], enforce_eager=True, max_model_len=256, num_kvcache_blocks=64,
          kvcache_block_size=16, device="cpu")
out = llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=8),
                   use_tqdm=False)
llm.exit()
print(json.dumps(sorted(m.__file__ for n, m in list(sys.modules.items())
                        if n.split(".")[0] == "nanovllm" and getattr(m, "__file__", None))))
"""


def package_files() -> list[str]:
    return sorted(
        os.path.join(d, f) for d, _, fs in os.walk(PACKAGE) for f in fs if f.endswith(".py")
    )


def module_name(path: str) -> str:
    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return name.removesuffix(".__init__")


def imports(path: str, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere in it (function-level imports included)."""
    found = set()
    is_package = path.endswith("__init__.py")
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module_name(path).split(".")
                keep = len(parts) - node.level + is_package
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
                break
    return found - {module_name(path)}


def test_a_plain_generate_loads_the_core_alone(ckpt_tied):
    out = subprocess.run(
        [sys.executable, "-c", PLAIN_GENERATE, ckpt_tied.path],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    files = json.loads(out.stdout.strip().splitlines()[-1])
    names = [module_name(f) for f in files]
    assert [n for n in names if n.startswith(FEATURES)] == []
    lines = sum(len(open(f).read().splitlines()) for f in files)
    assert lines <= PLAIN_PATH_LINES, f"the plain path loads {lines} lines in {len(files)} files"


def test_no_import_cycle_and_no_layer_imports_a_model():
    files = package_files()
    modules = {module_name(f) for f in files}
    graph = {module_name(f): imports(f, modules) for f in files}
    assert [
        (a, b)
        for a in graph
        for b in graph[a]
        if a.startswith("nanovllm.layers") and b.startswith("nanovllm.models")
    ] == []
    edges = graph
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node, [])


def test_files_stay_small_and_prose_stays_short():
    total = doc = 0
    for path in package_files():
        src = open(path).read()
        assert len(src.splitlines()) <= 300, f"{os.path.relpath(path, ROOT)} is over 300 lines"
        total += len(src)
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc += len(ast.get_docstring(node, clean=False) or "")
    assert doc / total <= 0.12, f"docstrings are {doc / total:.1%} of the package's characters"


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff(command):
    paths = ["nanovllm", "tests", "benchmarks", "bench.py", "example.py"]
    out = subprocess.run(["ruff", *command, *paths], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
