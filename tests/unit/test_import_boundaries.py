"""Algorithm and tooling modules import without vLLM; only named adapters may import it.

Each module is imported with ``sys.modules["vllm"] = None``, so any ``import
vllm...`` fails there. A module that needs vLLM must be listed in ADAPTERS —
adapters are thin and named after the vLLM class they extend. The modules that
must import without vLLM share one interpreter (the verdict per module is the
same as in a fresh one: vLLM is blocked for all of them, and a module whose
import fails is removed from ``sys.modules``, so it fails again wherever it is
imported); each adapter gets a fresh one, as it must fail on its own.
"""

from __future__ import annotations

import functools
import json
import pkgutil
import subprocess
import sys

import pytest

import vllm_ext

# modules allowed to import vLLM (adapters); everything else must not
ADAPTERS = {
    "vllm_ext.acct.connector",
    "vllm_ext.ark.connector",
    "vllm_ext.ark.prom",
    "vllm_ext.ark.nixl",
    "vllm_ext.common.prom",
    "vllm_ext.common.quantization_config",
    "vllm_ext.flide.api",
    "vllm_ext.flide.forward",
    "vllm_ext.flide.worker",
    "vllm_ext.histate.cache_policy",
    "vllm_ext.histate.connector",
    "vllm_ext.histate.device_pool",
    "vllm_ext.histate.metadata",
    "vllm_ext.leap.batch_layout",
    "vllm_ext.leap.connector",
    "vllm_ext.leap.loader",
    "vllm_ext.leap.request_queue",
    "vllm_ext.leap.scheduler",
    "vllm_ext.tvq.linear_method",
    "vllm_ext.etaps.linear_method",
}


def _all_modules() -> list[str]:
    found = [m.name for m in pkgutil.walk_packages(vllm_ext.__path__, "vllm_ext.")]
    return sorted(found + ["vllm_ext"])


def _imports_without_vllm(module: str) -> subprocess.CompletedProcess:
    code = f"import sys; sys.modules['vllm'] = None; import {module}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


_IMPORT_ALL = """
import importlib, json, sys, traceback
sys.modules["vllm"] = None
failures = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        failures[name] = traceback.format_exc()[-2000:]
print(json.dumps(failures))
"""


@functools.cache
def _failures_without_vllm() -> dict[str, str]:
    """Traceback per module (not an adapter) that fails to import without vLLM."""
    modules = [m for m in _all_modules() if m not in ADAPTERS]
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, *modules], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", [m for m in _all_modules() if m not in ADAPTERS])
def test_module_imports_without_vllm(module):
    assert module not in _failures_without_vllm(), _failures_without_vllm()[module]


def test_adapter_list_is_current():
    modules = set(_all_modules())
    assert ADAPTERS <= modules, f"stale adapter entries: {ADAPTERS - modules}"
    for module in ADAPTERS:
        assert _imports_without_vllm(module).returncode != 0, f"{module} no longer needs vLLM"
