"""The packed-attention Triton kernel and SDPA paths equal the fp32 reference on CPU.

The Triton kernel runs through Triton's interpreter (``TRITON_INTERPRET=1``,
CPU tensors), in a subprocess because the variable must be set before Triton
is first imported. The same cases run on a GPU in ``tests/gpu``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_triton_kernel_in_the_interpreter_equals_the_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "tests.kernel_cases", "cpu"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    checked = {line.split()[0] for line in out.stdout.splitlines()}
    assert checked == {"sdpa/float32", "blocks/float32", "triton/float32"}


def test_sdpa_paths_equal_the_reference_without_triton():
    from tests.kernel_cases import check

    worst = check("cpu")
    assert {"sdpa/float32", "blocks/float32"} <= set(worst)
