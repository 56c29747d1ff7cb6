"""The Triton kernels' CPU tests: TRITON_INTERPRET=1 is only honoured if it is set before triton is
first imported, and other test files import it first, so a test file's Triton cases run in a
subprocess (the file run as a script, printing its results as one JSON line)."""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


def results_under_interpreter(test_file: str, timeout: int = 600) -> dict:
    """Run ``test_file`` as a script under the interpreter; returns the JSON it printed last. The
    script imports the shared helpers of ``tests/`` and the modules beside it (its own folder)."""
    path = os.pathsep.join(
        filter(None, [str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH")])
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, test_file],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"{Path(test_file).name} under the interpreter:\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cases(cases: dict, call: Callable = lambda case: case()) -> dict:
    """``call(case)`` for each case (in the subprocess); an exception becomes that case's
    {"error": ...}."""
    results = {}
    for name, case in cases.items():
        try:
            results[name] = call(case)
        except Exception as e:  # reported per case by the tests
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    return results


def squeeze_interpreter_loop_bounds() -> None:
    """Older Triton interpreters (3.6) turn a scalar, which they hold as a 1-element array, into a
    loop bound with ``int(array)``; NumPy >= 2.5 refuses that. Newer ones squeeze it first: do the
    same."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def round_interpreter_casts_to_nearest() -> None:
    """The Triton interpreter (3.9) narrows float32 to e4m3 by adding the first cut-off bit to the
    mantissa, without carrying into the exponent (124.7 becomes 64, not 128) and without ties to
    even, and to bfloat16 by truncation, whatever the rounding mode asked for. A GPU rounds both to
    nearest even, in hardware. Narrow through torch (round to nearest even) instead, so the
    interpreter runs the kernels as the GPU does."""
    import numpy as np
    import torch
    from triton import language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    to_fp, trunc = builder.create_fp_to_fp, builder.create_fp_trunc

    def through_torch(src, dst_type, target: torch.dtype, bits: type):
        data = torch.from_numpy(np.ascontiguousarray(src.data)).to(target)
        return interpreter.TensorHandle(
            data.view(torch.uint8 if bits is np.uint8 else torch.int16).numpy().view(bits),
            dst_type.scalar,
        )

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # the e4m3 casts
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return through_torch(src, dst_type, torch.float8_e4m3fn, np.uint8)
        return to_fp(self, src, dst_type, rounding_mode)

    def create_fp_trunc(self, src, dst_type):  # the bfloat16 casts
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return through_torch(src, dst_type, torch.bfloat16, np.uint16)
        return trunc(self, src, dst_type)

    builder.create_fp_to_fp, builder.create_fp_trunc = create_fp_to_fp, create_fp_trunc


def multiply_bf16_as_floats() -> None:
    """The Triton interpreter (3.9) multiplies bfloat16 operands of ``tl.dot`` as the integers of
    their bit patterns (NumPy has no bfloat16). Widen them to float32 first, exactly, as the GPU's
    MMA does."""
    import numpy as np
    import torch
    from triton import language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = torch.from_numpy(np.ascontiguousarray(handle.data).view(np.int16))
        return interpreter.TensorHandle(bits.view(torch.bfloat16).float().numpy(), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = dot
