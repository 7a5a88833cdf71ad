"""Registered patches: guarded, idempotent, reversible, listed in patches/README.md, and the
only place that patches vLLM (the package is scanned for monkeypatches elsewhere)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_ext.patches import vllm_cpu_cli_version as cli_patch

REPO = Path(__file__).resolve().parents[2]
PATCH_DIR = REPO / "patches"
FIELDS = ("Target:", "Why:", "How:", "When applied:", "Upstream:", "Removal plan:")

# writes into vLLM objects outside patches/ that are not monkeypatches, with the reason
ALLOWED = {
    ("vllm_ext/flide/forward.py", "_modules"): (
        "swaps the loaded model's own layers for one packed pass and restores them in a "
        "finally block; no vLLM code changes (listed in compat.SEAMS)"
    ),
}


def _patch_modules() -> list[str]:
    return sorted(p.name for p in PATCH_DIR.glob("*.py") if p.name != "__init__.py")


def _register_sections() -> dict[str, str]:
    text = (PATCH_DIR / "README.md").read_text()
    sections = {}
    for chunk in text.split("\n## ")[1:]:
        title, _, body = chunk.partition("\n")
        sections[title.strip()] = body
    return sections


def test_register_lists_exactly_the_patch_modules_with_all_fields():
    modules, sections = _patch_modules(), _register_sections()
    assert modules, "no patch modules found"
    assert sorted(sections) == modules, "patches/README.md and patches/*.py disagree"
    for name in modules:
        for field in FIELDS:
            assert field in sections[name], f"{name}: no {field}"
        module = importlib.import_module(f"vllm_ext.patches.{name[:-3]}")
        for api in ("apply", "is_applied", "revert", "needed"):
            assert callable(getattr(module, api, None)), f"{name}: no {api}()"


def _vllm_names(tree: ast.AST) -> set[str]:
    """Names a module binds to vLLM (``import vllm.x as y``, ``from vllm.x import Y``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "vllm" or alias.name.startswith("vllm."):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "vllm" or node.module.startswith("vllm."):
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _written_attrs(tree: ast.AST):
    """``(node, attribute)`` of every attribute or subscript write, ``setattr`` and ``delattr``."""
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            attr = target.value if isinstance(target, ast.Subscript) else target
            if isinstance(attr, ast.Attribute):
                yield target, attr.attr
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and len(node.args) >= 2
        ):
            name = node.args[1]
            yield node.args[0], name.value if isinstance(name, ast.Constant) else "?"


def _patched_attrs() -> set[str]:
    """Attributes the registered patches write on vLLM objects (none but them may)."""
    names = set()
    for path in PATCH_DIR.glob("*.py"):
        for target, attr in _written_attrs(ast.parse(path.read_text())):
            if _root(target) != "self":
                names.add(attr)
    return names


def monkeypatches(source: str, patched: set[str]) -> list[tuple[int, str]]:
    """``(line, attribute)`` of each write into vLLM in ``source``: an attribute of a name
    bound to vLLM, ``_modules`` of anything, or an attribute a registered patch owns."""
    tree = ast.parse(source)
    vllm_names = _vllm_names(tree)
    found = []
    for target, attr in _written_attrs(tree):
        root = _root(target)
        if root in vllm_names or attr == "_modules" or (attr in patched and root != "self"):
            found.append((target.lineno, attr))
    return found


def test_no_monkeypatch_of_vllm_outside_patches():
    patched = _patched_attrs()
    assert {"block_pool", "get_num_blocks_to_allocate", "load_model"} <= patched
    offenders = []
    for path in sorted((REPO / "vllm_ext").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith("vllm_ext/patches/"):  # a local link to patches/, if any
            continue
        for line, attr in monkeypatches(path.read_text(), patched):
            if (relative, attr) not in ALLOWED:
                offenders.append(f"{relative}:{line} writes {attr}")
    assert not offenders, "monkeypatches outside patches/ (register them there):\n" + "\n".join(
        offenders
    )


@pytest.mark.parametrize(
    "source",
    [
        "from vllm.v1.core.sched.scheduler import Scheduler\nScheduler.schedule = f\n",
        "import vllm.model_executor.model_loader as ml\nml._LOADERS['x'] = 1\n",
        "from vllm import envs\nsetattr(envs, 'X', 1)\n",
        "def f(manager):\n    manager.block_pool = view\n",
        "def f(parent):\n    parent._modules['x'] = y\n",
    ],
)
def test_the_scan_finds_a_new_monkeypatch(source):
    assert monkeypatches(source, {"block_pool"})


def test_the_scan_leaves_a_subclass_own_state_alone():
    source = "class S(Scheduler):\n    def f(self):\n        self.running[:] = []\n"
    assert monkeypatches("from vllm import x\n" + source, {"running"}) == []


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


def test_v1_runner_handle_publishes_the_loading_runner_only_while_it_loads():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm_ext.patches import v1_runner_handle as handle

    if not handle.needed():
        pytest.skip("this vLLM has no V1 model runner")
    was_applied = handle.is_applied()
    seen = []
    original = CPUModelRunner.__dict__["load_model"]
    try:
        handle.revert()
        CPUModelRunner.load_model = lambda self, *a, **k: seen.append(handle.loading_runner())
        assert handle.apply() and handle.apply() and handle.is_applied()
        runner = object.__new__(CPUModelRunner)
        CPUModelRunner.load_model(runner)
        assert seen == [runner] and handle.loading_runner() is None
        handle.revert()
        assert not handle.is_applied()
    finally:
        CPUModelRunner.load_model = original
        if was_applied:
            handle.apply()


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
