"""Registered patches: guarded, idempotent, reversible, and listed in patches/README.md."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_ext.patches import vllm_cpu_cli_version as cli_patch

PATCH_DIR = Path(__file__).resolve().parents[2] / "patches"


def test_every_patch_module_is_registered_with_all_fields():
    register = (PATCH_DIR / "README.md").read_text()
    modules = sorted(p.name for p in PATCH_DIR.glob("*.py") if p.name != "__init__.py")
    assert modules, "no patch modules found"
    for name in modules:
        section = register.split(f"## {name}", 1)
        assert len(section) == 2, f"{name} missing from patches/README.md"
        for field in ("Target:", "Why:", "How:", "When applied:", "Upstream:", "Removal plan:"):
            assert field in section[1].split("\n## ", 1)[0], f"{name}: no {field}"
        module = importlib.import_module(f"vllm_ext.patches.{name[:-3]}")
        for api in ("apply", "is_applied", "revert"):
            assert callable(getattr(module, api)), f"{name}: no {api}()"


@pytest.mark.skipif(not cli_patch.needed(), reason="vLLM is installed as `vllm`, patch not needed")
def test_cli_patch_is_idempotent_and_reversible():
    import vllm.entrypoints.cli.main as cli_main

    assert not cli_patch.is_applied()
    assert cli_patch.apply() and cli_patch.apply()
    assert cli_patch.is_applied()
    assert cli_main.importlib.metadata.version("vllm").endswith("+cpu")
    # the rest of the process still sees the real metadata
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    cli_patch.revert()
    assert not cli_patch.is_applied()


@pytest.mark.skipif(not cli_patch.needed(), reason="vLLM is installed as `vllm`, patch not needed")
def test_plain_vllm_cli_fails_and_patched_one_starts():
    plain = subprocess.run(
        [sys.executable, "-c", "from vllm.entrypoints.cli.main import main; main()", "--version"],
        capture_output=True,
        text=True,
    )
    assert plain.returncode != 0 and "PackageNotFoundError" in plain.stderr
    patched = subprocess.run(
        [sys.executable, "-m", "vllm_ext.vllm_main", "--version"], capture_output=True, text=True
    )
    assert patched.returncode == 0 and "0.32" in patched.stdout
