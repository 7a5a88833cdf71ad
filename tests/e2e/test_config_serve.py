"""Plain `vllm serve` (no `vllm-ext`): a config typo stops it at plugin load, with one line.

vLLM loads general plugins while it builds its argument parser, so vllm_ext's
``register()`` sees ``sys.argv`` before any engine, model or worker exists. The
server must exit 2 with our line and none of vLLM's start-up logging (its
"non-default args" line is the first thing it logs after parsing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.e2e.conftest import SERVE_ARGS, server_env
from vllm_ext.assets import model_path


def test_plain_vllm_serve_refuses_a_typo_before_starting_anything():
    leap = {"leap": {"weigths_path": "w.npz", "experimental": {"risk_k": 1.0}}}
    cmd = [sys.executable, "-m", "vllm_ext.vllm_main", "serve", str(model_path("smollm2"))]
    cmd += [*SERVE_ARGS, "--additional-config", json.dumps(leap)]
    result = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **server_env()}, timeout=600
    )
    ours = [line for line in result.stderr.splitlines() if line.startswith("vllm serve: error:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(ours) == 1 and "unknown key 'weigths_path'" in ours[0]
    assert "valid: checkpoint_path, layer" in ours[0]
    assert "Traceback" not in result.stderr and "non-default args" not in result.stderr
