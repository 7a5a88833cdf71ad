"""Build and locate ARK's LD_PRELOAD bind/connect shim (``csrc/ark/ark_bind_shim.c``).

The shim applies planned source ports to TCP connections that native code
opens (NIXL/UCX, Mooncake TCP): see the C file for its rules. It is compiled
on first use with the system C compiler into the asset cache, keyed by the
source's hash, so an edited source is rebuilt and a built one is reused.
Use: ``LD_PRELOAD=<path> ARK_SPORT_MAP="10.0.0.1:47001=40001,40002" cmd``, or
``ctypes.CDLL(None).ark_shim_set(b"10.0.0.1", 47001, 40001)`` inside the
preloaded process.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "ark" / "ark_bind_shim.c"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm_ext" / "ark"


class ShimBuildError(RuntimeError):
    """The shim could not be built (no compiler, no source, compiler error)."""


def build(cache: Path = CACHE, source: Path = SOURCE) -> Path:
    """Path of the compiled shim, building it if needed."""
    if not source.is_file():
        raise ShimBuildError(f"shim source not found at {source} (needs a source checkout)")
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    out = cache / f"ark_bind_shim-{digest}.so"
    if out.is_file():
        return out
    if compiler is None:
        raise ShimBuildError("no C compiler found (set CC or install gcc)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", str(tmp),
           str(source), "-ldl", "-lpthread"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ShimBuildError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    tmp.replace(out)
    return out
