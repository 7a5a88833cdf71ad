"""The vLLM 0.34 tier: our vLLM-facing classes driven by vLLM 0.34's own code.

Runs only in a process that imports 0.34's tree (``make test-034``:
``PYTHONPATH=.vllm-releases/0.34.0``, see ``tests/vllm_releases.py``); under
the installed 0.32 engine every test here is skipped by ``tests/conftest.py``,
and here it is an error if the release is not the one imported. Helpers in
this folder build 0.34's configs, schedulers and managers the way vLLM's own
tests do (its ``tests/v1/core/utils.py::create_scheduler`` included), on local
stand-in models (:mod:`release_shim`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import release_shim  # noqa: E402

RELEASE = os.environ.get("VLLM_EXT_RELEASE_UNDER_TEST", "")


def pytest_configure(config):
    if not RELEASE:
        return
    import vllm

    if vllm.__version__ != RELEASE:
        raise pytest.UsageError(
            f"the {RELEASE} tier imported vLLM {vllm.__version__} from {vllm.__file__}"
        )
    release_shim.use_offline_hub(TESTS.parent / ".vllm-releases" / "hub")
    release_shim.allow_cpu_without_triton()
