"""Find every module of vllm_ext that imports vLLM (the adapters compat_check imports).

By scanning source, not by a hand list: a module counts when it imports vLLM
anywhere in it, or at module level imports another vllm_ext module or patch
that does (``histate.device_pool`` through ``patches/mamba_block_pool_release``).
Imports no vLLM.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "vllm_ext"


def _imports(tree: ast.Module, top_level: bool) -> set[str]:
    nodes = tree.body if top_level else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def adapters() -> tuple[str, ...]:
    """Every module under vllm_ext that imports vLLM: directly (anywhere in it), or at
    module level through another vllm_ext module or patch that does."""
    trees = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        trees[name] = ast.parse(path.read_text())
    for path in (REPO / "patches").glob("[a-z]*.py"):
        trees[f"vllm_ext.patches.{path.stem}"] = ast.parse(path.read_text())
    found = {n for n, t in trees.items() if "vllm" in {i.split(".")[0] for i in _imports(t, False)}}
    changed = True
    while changed:  # module-level imports of a module that imports vLLM
        changed = False
        for name, tree in trees.items():
            if name not in found and _imports(tree, True) & found:
                found.add(name)
                changed = True
    return tuple(sorted(n for n in found if not n.startswith("vllm_ext.patches.")))
