"""Check every vLLM seam of vllm_ext against each release we test, and write docs/compat.md.

``python -m vllm_ext.common.compat_check render`` checks vLLM 0.32 (the
installed build) and 0.33/0.34 (their source trees under ``.vllm-releases/``,
imported by a subprocess run with ``tests.vllm_releases.release_env``), writes
one report per release to ``.compat/<version>.json`` and renders
``docs/compat.md`` (:mod:`vllm_ext.common.compat_doc`). ``check`` checks the
vLLM this interpreter imports.

``check`` is import-level only: every seam each system declares
(``vllm_ext/<system>/seams.py``: symbols, signatures, the calls vLLM makes into
our overrides), then every module under vllm_ext that imports vLLM (found by
scanning, :func:`adapters`), every method our classes override (the classes
found in those modules, :func:`our_classes`) compared with the vLLM method it
overrides, abstract methods implemented, ``SupportsHMA``, the worker
extension's names free on vLLM's workers, our entry-point groups and each
registered patch's ``needed()``. ``instance`` entries are verified on real
objects by the tests :mod:`vllm_ext.common.compat_evidence` names.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_ext.common import compat, compat_doc
from vllm_ext.common.compat_evidence import ENGINE_CHECKED, INSTANCE_TESTS
from vllm_ext.common.compat_scan import REPO, adapters

REPORTS = REPO / ".compat"
DOC = REPO / "docs" / "compat.md"
RELEASES = ("0.32.0", "0.33.0", "0.34.0")  # 0.32: the installed build; others: their sdists
WORKERS = ("vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.cpu_worker:CPUWorker")
PATCHES = tuple(sorted(p.stem for p in (REPO / "patches").glob("[a-z]*.py")))


def _system(module: str) -> str:
    part = module.split(".")[1]
    return part if part in compat.SYSTEMS else "common"


def _row(system: str, seam: str, status: str, detail: str = "") -> dict:
    return {"system": system, "seam": seam, "status": status, "detail": detail}


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]


def table_rows(version: str) -> list[dict]:
    v1 = compat.has_v1_runner()
    rows = []
    series = compat.parse_series(version)
    for seam in compat.SEAMS:
        if not seam.applies_to(series):
            continue  # vLLM added or dropped it, and our code follows (Seam.releases)
        if seam.runner == "v1" and not v1:
            continue  # no V1 runner on this release: LEAP's probe takes the V2 path
        problem = compat.seam_problem(seam)
        moved = compat._found(seam).module
        if problem is None and moved != seam.module:
            detail = f"moved to {moved} (found by compat.locate, which our code calls)"
            rows.append(_row(seam.system, seam.name, "ok", detail))
        elif problem is None and seam.kind == "instance":
            test, not_built = INSTANCE_TESTS.get(version, (None, frozenset()))
            engine_test, in_engine = ENGINE_CHECKED.get(version, (None, frozenset()))
            if seam.name in in_engine and seam.system == "flide":
                detail = f"on a real instance: {engine_test}"
                rows.append(_row(seam.system, seam.name, "ok", detail))
            elif test is None or seam.name in not_built:
                detail = "class only: no test builds this instance on this release"
                rows.append(_row(seam.system, seam.name, "unverified", detail))
            else:
                rows.append(_row(seam.system, seam.name, "ok", f"on a real instance: {test}"))
        elif problem is None:
            rows.append(_row(seam.system, seam.name, "ok"))
        else:
            status = "missing" if problem.startswith(("missing", "module")) else "changed"
            rows.append(_row(seam.system, seam.name, status, problem))
    return rows


def adapter_rows() -> list[dict]:
    rows = []
    for module in adapters():
        try:
            importlib.import_module(module)
            rows.append(_row(_system(module), f"import {module}", "ok"))
        except Exception as exc:  # any import failure is the finding
            rows.append(_row(_system(module), f"import {module}", "missing", _short(exc)))
    return rows


def our_classes() -> list[tuple[str, type]]:
    """(system, class) for every class in an adapter module that extends a vLLM class."""
    found = []
    for module in adapters():
        try:
            mod = importlib.import_module(module)
        except Exception:
            continue  # adapter_rows reports it
        for value in vars(mod).values():
            if inspect.isclass(value) and value.__module__ == module and _vllm_bases(value):
                found.append((_system(module), value))
    return found


def _vllm_bases(cls: type) -> list[type]:
    return [b for b in cls.__mro__ if b.__module__.split(".")[0] == "vllm"]


def _accepts(ours: inspect.Signature, theirs: inspect.Signature) -> str | None:
    """None when a call made with vLLM's parameters binds to ours."""
    params = list(ours.parameters.values())
    if any(p.kind == p.VAR_POSITIONAL for p in params) and any(
        p.kind == p.VAR_KEYWORD for p in params
    ):
        return None
    names = [p.name for p in params]
    wanted = [p.name for p in theirs.parameters.values() if p.kind not in (p.VAR_POSITIONAL,)]
    absent = [n for n in wanted if n not in names and not (n == "kwargs" and "kwargs" in names)]
    if absent and not any(p.kind == p.VAR_KEYWORD for p in params):
        return f"vLLM's takes ({', '.join(theirs.parameters)}), ours ({', '.join(names)})"
    return None


def overrides(cls: type) -> list[tuple[str, type]]:
    """(method, the vLLM class it overrides) for each method our part of ``cls`` defines."""
    ours = [b for b in cls.__mro__ if b.__module__.startswith("vllm_ext.")]
    out = []
    for name in sorted({n for b in ours for n, v in vars(b).items() if callable(v)}):
        base = next((b for b in _vllm_bases(cls) if name in vars(b)), None)
        if base is not None and (not name.startswith("__") or name == "__init__"):
            out.append((name, base))
    return out


def _function(path: str):
    """The function ``"module:Class.method"`` names (inherited ones compare equal)."""
    module, _, qualname = path.partition(":")
    owner, _, method = qualname.rpartition(".")
    try:
        value = getattr(getattr(importlib.import_module(module), owner), method)
    except (ImportError, AttributeError):
        return path
    return getattr(value, "__func__", value)


def override_rows() -> list[dict]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    called = {_function(s.ours) for s in compat.SEAMS if s.kind == "call"}
    rows = []
    for system, cls in our_classes():
        path = f"{cls.__module__}:{cls.__name__}"
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(cls.__abstractmethods__))
            rows.append(_row(system, f"{path} abstract methods", "changed", missing))
        # hybrid (Mamba) models need HMA; ARK and ACCT serve attention-only models
        if cls.__name__ in ("LeapConnector", "HiStateConnector"):
            ok = issubclass(cls, SupportsHMA)
            rows.append(_row(system, f"{path} is SupportsHMA", "ok" if ok else "changed"))
        for name, base in overrides(cls):
            try:
                problem = _accepts(
                    inspect.signature(getattr(cls, name)), inspect.signature(getattr(base, name))
                )
            except (TypeError, ValueError):
                continue
            label = f"{cls.__name__}.{name} overrides {base.__name__}.{name}"
            rows.append(_row(system, label, "changed" if problem else "ok", problem or ""))
            if _function(f"{path}.{name}") in called:
                continue  # the call entries' own rows say how vLLM calls it
            owner = next(b for b in cls.__mro__ if name in vars(b)).__name__
            why = compat.UNCALLED.get(f"{owner}.{name}")
            label = f"how vLLM calls {cls.__name__}.{name}"
            if why is not None:
                rows.append(_row(system, label, "ok", f"vLLM does not call it: {why}"))
            else:
                rows.append(_row(system, label, "unchecked", compat_doc.NO_CALL_SITE))
    return rows


def worker_rows() -> list[dict]:
    from vllm_ext.flide.worker import FlideWorkerExtension

    names = [n for n in vars(FlideWorkerExtension) if not n.startswith("__")]
    rows = []
    for path in WORKERS:
        module, _, name = path.partition(":")
        try:
            worker = getattr(importlib.import_module(module), name)
        except Exception as exc:
            rows.append(_row("flide", f"{path} (worker extension host)", "missing", _short(exc)))
            continue
        clash = [n for n in names if hasattr(worker, n)]
        detail = f"names taken: {', '.join(clash)}" if clash else ""
        status = "changed" if clash else "ok"
        rows.append(_row("flide", f"{path} takes the worker extension", status, detail))
    return rows


def entry_point_rows() -> list[dict]:
    from importlib.metadata import distribution

    import vllm.plugins as plugins

    groups = {plugins.DEFAULT_PLUGINS_GROUP, plugins.ENDPOINT_PLUGINS_GROUP}
    rows = []
    for ep in distribution("vllm-ext").entry_points:
        if not ep.group.startswith("vllm."):
            continue
        status, detail = "ok", ""
        if ep.group not in groups:
            status, detail = "missing", "vLLM no longer loads this group"
        else:
            try:
                ep.load()
            except Exception as exc:
                status, detail = "missing", _short(exc)
        rows.append(_row("common", f"entry point {ep.group}:{ep.name}", status, detail))
    return rows


def patch_rows() -> list[dict]:
    rows = []
    for name in PATCHES:
        try:
            needed = importlib.import_module(f"vllm_ext.patches.{name}").needed()
        except Exception as exc:
            rows.append(_row("patches", f"patches/{name}.py", "missing", _short(exc)))
            continue
        detail = "applies" if needed else "not applied here (guard)"
        rows.append(_row("patches", f"patches/{name}.py", "ok", detail))
    return rows


def check(report: Path | None = None) -> dict:
    """Every row for the vLLM this interpreter imports; written to ``report`` if given."""
    version = compat.release(compat.installed_vllm_version()) or "unknown"
    rows = table_rows(version) + adapter_rows() + override_rows() + worker_rows()
    rows += entry_point_rows() + patch_rows()
    result = {"vllm": version, "v1_runner": compat.has_v1_runner(), "rows": rows}
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(result, indent=1) + "\n")
    return result


def release_env(version: str) -> dict[str, str]:
    """The environment a subprocess checks ``version`` in (0.32: the installed build)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)  # this checkout's vllm_ext (and its patches)
    if version == RELEASES[0]:
        return env
    sys.path.insert(0, str(REPO))
    from tests.vllm_releases import release_env as sdist_env

    return sdist_env(version, env)


def check_releases(versions=RELEASES) -> list[dict]:
    """Check each release in its own subprocess (in parallel); the reports, oldest first."""
    procs = []
    for version in versions:
        report = REPORTS / f"{version}.json"
        report.unlink(missing_ok=True)
        command = [sys.executable, "-m", "vllm_ext.common.compat_check", "check", "--report"]
        procs.append((version, report, subprocess.Popen(
            [*command, str(report)], cwd=REPO, env=release_env(version),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )))  # fmt: skip
    reports = []
    for version, report, proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0 or not report.exists():
            raise RuntimeError(f"compat check of vLLM {version} failed:\n{err[-3000:]}")
        reports.append(json.loads(report.read_text()))
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.common.compat_check")
    sub = parser.add_subparsers(dest="command", required=True)
    check_cmd = sub.add_parser("check", help="check this interpreter's vLLM")
    check_cmd.add_argument("--report", type=Path)
    sub.add_parser("render", help=f"check {', '.join(RELEASES)}; write docs/compat.md")
    args = parser.parse_args(argv)
    if args.command == "check":
        result = check(args.report)
        bad = [r for r in result["rows"] if r["status"] != "ok"]
        for r in bad:
            print(f"{r['status']:10} {r['system']:8} {r['seam']}: {r['detail']}")
        print(f"vLLM {result['vllm']}: {len(result['rows']) - len(bad)} ok, {len(bad)} not ok")
        return 0
    reports = check_releases()
    DOC.write_text(compat_doc.render(reports))
    print(f"wrote {DOC.relative_to(REPO)} ({', '.join(r['vllm'] for r in reports)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
