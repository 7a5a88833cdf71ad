"""Swap a mutant's twins in: now for modules already imported, at import for the others.

The import hook makes one mechanism serve the pytest process (the plugin) and
every Python process it starts (``site/sitecustomize.py``: ``vllm serve``, its
engine core, TP workers), with no line of product code involved.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

# neither VLLM_EXT_* nor VLLMEXT_*: vllm_ext refuses unknown variables with its prefixes
ENV = "MUTANT_VLLM_EXT"
_installed: set[str] = set()  # the plugin and sitecustomize may both run in one process


def _patch(module, qualname: str, factory) -> None:
    *owners, attr = qualname.split(".")
    owner = module
    for name in owners:
        owner = getattr(owner, name)
    original = getattr(owner, attr)
    if getattr(original, "_mutant_twin", False):
        return  # already swapped (the plugin and sitecustomize both ran)
    twin = factory(original)
    try:
        twin._mutant_twin = True
    except AttributeError:
        pass
    setattr(owner, attr, twin)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs the pending patches of a module right after the module executes."""

    def __init__(self, pending: dict[str, list]):
        self.pending = pending

    def find_spec(self, fullname, path, target=None):
        patches = self.pending.get(fullname)
        if not patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for qualname, factory in self.pending.pop(fullname, ()):
                _patch(module, qualname, factory)

        spec.loader.exec_module = exec_module
        return spec


def install(name: str) -> None:
    """Swap in mutant ``name`` of :data:`tests.mutants.table.MUTANTS`."""
    from tests.mutants.table import by_name

    if name in _installed:
        return
    _installed.add(name)
    mutant = by_name(name)
    pending: dict[str, list] = {}
    for module_name, qualname, factory in mutant.patches:
        module = sys.modules.get(module_name)
        if module is not None:
            _patch(module, qualname, factory)
        else:
            pending.setdefault(module_name, []).append((qualname, factory))
    if pending:
        sys.meta_path.insert(0, _PatchOnImport(pending))
