"""The README's RL example (an adapter trained with PEFT, pushed from memory each step) runs on
the CPU as written."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_readme_rl_adapter_example_runs(tmp_path):
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("One RL loop that trains an adapter") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace("/tmp/tiny-qwen3-lora", str(tmp_path / "tiny"))
    script = tmp_path / "rl_lora.py"
    script.write_text(code)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = re.findall(r"step (\d): loss (\d+\.\d+)", out.stdout)
    assert [step for step, _ in losses] == ["0", "1", "2"], out.stdout
