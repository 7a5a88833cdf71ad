"""Copy a finished run from ``benchmarks/out/`` into ``benchmarks/results/`` (what docs cite).

``python -m benchmarks.promote NAME [NAME ...]`` copies ``NAME.json``, ``.md``
and ``.png``. It refuses a run

- made from a dirty checkout (its fingerprint says ``git.dirty``), unless
  ``--allow-dirty`` is given *and* the run recorded the sha256 of its
  ``git diff HEAD`` (then the hash travels with the result);
- whose code changed while it ran (``git.changed_during_run``: a commit or a
  tracked file newer than the run's start), so neither state describes it;
- whose commit is not HEAD or an ancestor of it (the code is not in this branch);
- that was a quick run (``config.quick``, or any file under ``benchmarks/out/quick/``);
- whose headline has fewer rounds than its suite entry needs (3 unless the
  benchmark is deterministic).

Nothing is committed: review the copied files and commit them yourself.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.suite import MIN_ROUNDS, OUT, QUICK_OUT, by_name

SUFFIXES = (".json", ".md", ".png")
_SHA = re.compile(r"^[0-9a-f]{40}$")


class PromoteError(RuntimeError):
    """A run that must not become a published result; the message says why."""


def check(data: dict[str, Any], repo: Path, allow_dirty: bool = False) -> None:
    """Raise :class:`PromoteError` unless the result ``data`` may be published."""
    name = data.get("name", "?")
    git = (data.get("fingerprint") or {}).get("git") or {}
    commit = git.get("commit")
    if not isinstance(commit, str) or not _SHA.match(commit):
        raise PromoteError(f"{name}: no git commit recorded ({commit!r})")
    # before the dirty check: a diff hash taken at the end does not describe it either
    if git.get("changed_during_run") is True:
        raise PromoteError(
            f"{name}: the checkout changed while it ran (a commit or a tracked file is newer "
            "than the run's start); rerun it on a checkout nobody edits"
        )
    dirty = git.get("dirty")
    if dirty is not False:
        if dirty is not True:
            raise PromoteError(f"{name}: the checkout's state was not recorded ({dirty!r})")
        digest = git.get("diff_sha256")
        if not allow_dirty:
            raise PromoteError(
                f"{name}: made from a dirty checkout of {commit[:12]}; rerun from a clean "
                "commit (or pass --allow-dirty to publish it with its recorded diff hash)"
            )
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise PromoteError(f"{name}: dirty run without a recorded diff hash ({digest!r})")
    if not _is_ancestor(repo, commit):
        raise PromoteError(f"{name}: commit {commit[:12]} is not HEAD or an ancestor of it")
    if (data.get("config") or {}).get("quick"):
        raise PromoteError(f"{name}: a quick run is not a headline result")
    rounds = (data.get("headline") or {}).get("rounds", 0)
    entry = by_name(name)
    need = entry.min_rounds if entry else MIN_ROUNDS
    if rounds < need:
        raise PromoteError(f"{name}: headline over {rounds} round(s); {need} needed")


def _is_ancestor(repo: Path, commit: str) -> bool:
    done = subprocess.run(
        ["git", "-C", str(repo), "merge-base", "--is-ancestor", commit, "HEAD"],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def promote(
    name: str,
    source: Path,
    target: Path,
    repo: Path,
    allow_dirty: bool = False,
) -> list[Path]:
    """Check the run ``source/name.json`` and copy its files to ``target``; the copies."""
    src, quick = source.resolve(), (repo / QUICK_OUT).resolve()
    if src == quick or quick in src.parents or src.name == quick.name:
        raise PromoteError(f"{name}: {source} holds quick runs")
    path = source / f"{name}.json"
    if not path.exists():
        raise PromoteError(f"{name}: no run at {path}")
    check(json.loads(path.read_text(encoding="utf-8")), repo, allow_dirty)
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for suffix in SUFFIXES:
        src = source / f"{name}{suffix}"
        if src.exists():
            copied.append(Path(shutil.copy2(src, target / src.name)))
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", help="result names (file stems)")
    parser.add_argument("--from", dest="source", type=Path, default=OUT)
    parser.add_argument("--to", dest="target", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the git checkout")
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="accept a run from a dirty checkout if it recorded its diff hash",
    )
    args = parser.parse_args(argv)
    failed = 0
    for name in args.names:
        try:
            copied = promote(name, args.source, args.target, args.repo, args.allow_dirty)
        except PromoteError as exc:
            sys.stderr.write(f"refused: {exc}\n")
            failed += 1
            continue
        sys.stdout.write(f"promoted {name}: {', '.join(str(p) for p in copied)}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
