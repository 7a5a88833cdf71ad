"""Test tiers and shared fixtures.

Tiers follow the folder a test lives in (``unit/``, ``engine/``, ``e2e/``,
``gpu/``) and get the matching marker; tiers the machine cannot run are
skipped with the reason. Engines run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ~5 s to start) and are shared per module.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# must be set before vLLM is imported anywhere in this process
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TIERS = ("unit", "engine", "e2e", "gpu", "vllm034")
# the tier that runs a newer release's code, only where that code is imported (make test-034)
RELEASE_TIERS = {"vllm034": "0.34.0"}


def _has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _tp2_skip_reason() -> str | None:
    # os.sched_getaffinity: the CPUs this process may use, which a container or taskset limits
    usable = len(os.sched_getaffinity(0))
    return f"tensor parallel 2 needs 2 usable CPUs, found {usable}" if usable < 2 else None


def pytest_collection_modifyitems(config, items):
    skip_reasons = {}
    tp2_reason = _tp2_skip_reason()
    if tp2_reason is not None:
        skip_reasons["tp2"] = tp2_reason
    if not _has_vllm():
        skip_reasons["engine"] = skip_reasons["e2e"] = "vLLM is not installed"
    if not _has_cuda():
        skip_reasons["gpu"] = "no CUDA device"
    for tier, version in RELEASE_TIERS.items():
        if os.environ.get("VLLM_EXT_RELEASE_UNDER_TEST") != version:
            skip_reasons[tier] = f"needs vLLM {version}'s code imported: make test-034"
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        for marker, reason in skip_reasons.items():
            if item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))
