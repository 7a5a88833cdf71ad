"""vllm_ext.bench's modules import alone and form no import circle (lazy imports included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_ext" / "bench"
MODULES = sorted(f"vllm_ext.bench.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _bench_imports(path: Path) -> set[str]:
    """vllm_ext.bench modules ``path`` imports anywhere (top level, functions, TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n in MODULES}
    return found


def test_no_import_circle_between_bench_modules() -> None:
    graph = {m: _bench_imports(PACKAGE / f"{m.rsplit('.', 1)[1]}.py") for m in MODULES}

    def visit(module: str, path: tuple[str, ...]) -> None:
        for dep in graph[module]:
            assert dep not in path, f"import circle: {' -> '.join((*path, dep))}"
            visit(dep, (*path, dep))

    for module in MODULES:
        visit(module, (module,))
    assert "vllm_ext.bench.results" in graph["vllm_ext.bench.report"]
    assert "vllm_ext.bench.report" not in graph["vllm_ext.bench.results"]


def test_each_module_imports_alone_and_light() -> None:
    # one fresh interpreter per module: an order-dependent import would fail here
    heavy = ("vllm", "torch", "matplotlib", "openai")
    code = (
        "import importlib, sys; importlib.import_module(sys.argv[1]); "
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    for module in ["vllm_ext.bench", *MODULES]:
        done = subprocess.run(
            [sys.executable, "-c", code, module], capture_output=True, text=True, cwd=ROOT
        )
        assert done.returncode == 0, f"{module}: {done.stderr[-2000:]}"
        assert done.stdout.strip() == "", f"{module} imports {done.stdout.strip()} eagerly"
