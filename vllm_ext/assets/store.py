"""Checksummed, atomically built asset folders in a cache directory outside git.

An asset is a folder built by a function. It counts as present only when its
``MANIFEST.json`` lists every file with size and sha256 and those match, and the
manifest records the recipe version: a changed recipe rebuilds. Builds happen in
a temporary sibling folder renamed into place, so an interrupted build never
leaves a half-written asset that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from vllm_ext.common.config import reject_old_env
from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

MANIFEST = "MANIFEST.json"
# outside the VLLM_ prefix: vLLM 0.34 refuses to start beside an unknown VLLM_* variable
CACHE_ENV = "VLLMEXT_ASSETS_DIR"


def cache_dir() -> Path:
    """``$VLLMEXT_ASSETS_DIR`` or ``~/.cache/vllm_ext/assets``."""
    # the old name set means a folder the user chose: never fall back to the default silently
    reject_old_env(os.environ, "VLLM_EXT_ASSETS_DIR")
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vllm_ext" / "assets"
    return Path(root)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, recipe: str) -> dict:
    """Record size and sha256 of every file under ``folder``."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            rel = path.relative_to(folder).as_posix()
            files[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"recipe": recipe, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def check(folder: Path, recipe: str, *, full: bool) -> str | None:
    """Return why ``folder`` is not a valid asset of ``recipe``, or ``None`` when it is.

    ``full=False`` compares sizes only (fast, for every use); ``full=True`` also
    re-hashes every file.
    """
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return "missing or unreadable manifest"
    if manifest.get("recipe") != recipe:
        return f"recipe {manifest.get('recipe')!r} != {recipe!r}"
    for rel, meta in manifest.get("files", {}).items():
        path = folder / rel
        if not path.is_file() or path.stat().st_size != meta["bytes"]:
            return f"{rel}: missing or wrong size"
        if full and sha256_file(path) != meta["sha256"]:
            return f"{rel}: checksum mismatch"
    return None


def ensure(
    name: str,
    recipe: str,
    build: Callable[[Path], None],
    *,
    verify: bool = False,
    force: bool = False,
) -> Path:
    """Return the folder of asset ``name``, building it first when absent or invalid.

    Args:
        name: folder name under :func:`cache_dir`.
        recipe: version string of the build recipe; a different one rebuilds.
        build: writes the asset's files into the (empty) folder it is given.
        verify: re-hash every file of an existing asset. Default: sizes only.
        force: rebuild even when valid.
    """
    target = cache_dir() / name
    problem = "forced rebuild" if force else check(target, recipe, full=verify)
    if problem is None:
        return target
    if target.exists():
        logger.info("Rebuilding asset %s: %s", name, problem)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        build(tmp)
        write_manifest(tmp, recipe)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Built asset %s in %s", name, target)
    return target
