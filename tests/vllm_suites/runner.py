"""Run a file of vLLM's own test suite, with our classes swapped in, and read its outcomes.

The suite runs in a subprocess with the release's sdist as rootdir (its
``tests`` package and conftest), the release's ``vllm`` tree first on the path
(the installed CPU build for 0.32), an offline hub cache of local stand-in
models and :mod:`swap_plugin`. Outcomes come back from a junit XML report,
one per test node id.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path.insert(0, str(TESTS))

import vllm_releases  # noqa: E402

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


def suite_env(version: str, swap: str, hub: Path) -> dict[str, str]:
    release = vllm_releases.RELEASES[version]
    env = dict(os.environ)
    # this checkout's vllm_ext (not wherever it was pip-installed from), our suite plugins
    paths = [str(HERE), str(TESTS), str(TESTS.parent)]
    if release.with_code:
        env = vllm_releases.release_env(version, env)
        paths.insert(0, str(release.folder))
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["VLLM_EXT_SWAP"] = swap
    env["HF_HUB_CACHE"] = str(hub)
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def run_suite(version: str, files: list[str], swap: str, out: Path, timeout: int = 1200,
              extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Outcome per test (``path::name[params]``) of ``files`` in vLLM ``version``'s suite."""
    import release_shim

    release = vllm_releases.RELEASES[version]
    vllm_releases.fetch(release)
    hub = release_shim.offline_hub(out / "hub")
    report = out / f"{version}-{swap or 'stock'}.xml"
    command = [
        sys.executable, "-m", "pytest", *files, "-q", "-p", "swap_plugin",
        "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}",
        "-W", "ignore::DeprecationWarning", *extra,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=release.folder, env=suite_env(version, swap, hub), timeout=timeout,
        capture_output=True, text=True,
    )  # fmt: skip
    if not report.exists():
        raise RuntimeError(f"vLLM {version} suite did not run:\n{done.stdout[-4000:]}\n"
                           f"{done.stderr[-4000:]}")
    return outcomes(report)


def outcomes(report: Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        node = f"{path}.py::{case.get('name')}"
        if case.find("skipped") is not None:
            result[node] = SKIPPED
        elif case.find("failure") is not None or case.find("error") is not None:
            result[node] = FAILED
        else:
            result[node] = PASSED
    return result
