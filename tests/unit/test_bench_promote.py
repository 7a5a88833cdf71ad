"""``python -m benchmarks.promote``: only clean, full, multi-round runs become published results."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.promote import PromoteError, main, promote
from vllm_ext.bench import BenchResult, collect_fingerprint, headline_from_rounds, write_result

pytestmark = pytest.mark.unit


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture()
def repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q", "-b", "main")
    _git(root, "config", "user.email", "t@example.com")
    _git(root, "config", "user.name", "t")
    (root / "code.py").write_text("x = 1\n")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "init")
    return root


def _run(
    repo: Path, name: str = "demo", rounds: int = 3, started: float | None = None, **config
) -> Path:
    """A real result file as a run in ``repo``'s current state would write it.

    The run started at ``started`` (default: now, after every change the test made).
    """
    out = repo / "benchmarks" / "out"
    result = BenchResult(
        name=name,
        description="d",
        variants={"ours": {"x": 1.0}, "base": {"x": 2.0}},
        headline=headline_from_rounds(
            "x", [1.0 + i for i in range(rounds)], [2.0] * rounds, "base", False
        ),
        fingerprint=collect_fingerprint(
            repo_dir=repo, include_torch=False, started=time.time() if started is None else started
        ),
        config=config,
    )
    write_result(result, out)
    return out


def test_clean_run_is_copied(repo) -> None:
    out = _run(repo)
    target = repo / "benchmarks" / "results"
    copied = promote("demo", out, target, repo)
    assert sorted(p.name for p in copied) == ["demo.json", "demo.md", "demo.png"]
    assert (target / "demo.json").read_text() == (out / "demo.json").read_text()


def test_run_from_a_dirty_tree_is_refused_by_default(repo) -> None:
    (repo / "code.py").write_text("x = 2\n")  # uncommitted change to the measured code
    out = _run(repo)
    target = repo / "benchmarks" / "results"
    with pytest.raises(PromoteError, match="dirty checkout"):
        promote("demo", out, target, repo)
    assert not target.exists()
    # committing afterwards does not launder the run: its fingerprint says dirty
    _git(repo, "commit", "-qam", "change")
    with pytest.raises(PromoteError, match="dirty"):
        promote("demo", out, target, repo)
    # explicitly allowed, it goes with the diff hash the run recorded
    promote("demo", out, target, repo, allow_dirty=True)
    git = json.loads((target / "demo.json").read_text())["fingerprint"]["git"]
    assert git["dirty"] is True and len(git["diff_sha256"]) == 64


def test_run_whose_code_changed_while_it_ran_is_refused(repo) -> None:
    started = time.time()
    time.sleep(0.05)  # longer than the kernel's coarse file-time tick: the edit is after it
    (repo / "code.py").write_text("x = 3\n")
    with pytest.raises(PromoteError, match="changed while it ran"):
        promote("demo", _run(repo, started=started), repo / "r", repo)
    # committed before the run ends the tree is clean again, yet the run used both versions
    _git(repo, "commit", "-qam", "mid-run")
    out = _run(repo, started=started)
    git = json.loads((out / "demo.json").read_text())["fingerprint"]["git"]
    assert git["dirty"] is False and git["changed_during_run"] is True
    with pytest.raises(PromoteError, match="changed while it ran"):
        promote("demo", out, repo / "r", repo)
    # a commit with no file touched after the start (e.g. a checkout's HEAD moved) counts too
    later = int(time.time()) + 1  # committer time is whole seconds: start on one
    time.sleep(later + 1.05 - time.time())
    _git(repo, "commit", "-q", "--allow-empty", "-m", "empty")
    late = json.loads((_run(repo, started=later) / "demo.json").read_text())
    assert late["fingerprint"]["git"]["changed_during_run"] is True
    promote("demo", _run(repo), repo / "r", repo)  # a fresh run on the settled tree passes


def test_dirty_run_without_a_diff_hash_is_refused_even_when_allowed(repo) -> None:
    out = _run(repo)
    path = out / "demo.json"
    data = json.loads(path.read_text())
    data["fingerprint"]["git"]["dirty"] = True  # as the results written before this change
    path.write_text(json.dumps(data))
    with pytest.raises(PromoteError, match="diff hash"):
        promote("demo", out, repo / "r", repo, allow_dirty=True)


def test_commit_outside_the_branch_quick_runs_and_few_rounds_are_refused(repo) -> None:
    out = _run(repo)
    _git(repo, "checkout", "-q", "--orphan", "other")
    _git(repo, "commit", "-qm", "unrelated")
    with pytest.raises(PromoteError, match="not HEAD or an ancestor"):
        promote("demo", out, repo / "r", repo)
    _git(repo, "checkout", "-q", "main")
    with pytest.raises(PromoteError, match="quick run"):
        promote("q", _run(repo, "q", quick=True), repo / "r", repo)
    with pytest.raises(PromoteError, match="2 round"):
        promote("few", _run(repo, "few", rounds=2), repo / "r", repo)
    quick_dir = repo / "benchmarks" / "out" / "quick"
    quick_dir.mkdir()
    (quick_dir / "demo.json").write_text((out / "demo.json").read_text())
    with pytest.raises(PromoteError, match="quick runs"):
        promote("demo", quick_dir, repo / "r", repo)
    with pytest.raises(PromoteError, match="no run"):
        promote("missing", out, repo / "r", repo)


def test_cli_exit_code(repo, capsys) -> None:
    out = _run(repo)
    (repo / "code.py").write_text("x = 3\n")
    _run(repo, "dirty")
    args = ["--from", str(out), "--to", str(repo / "r"), "--repo", str(repo)]
    assert main(["demo", *args]) == 0
    assert main(["demo", "dirty", *args]) == 1
    captured = capsys.readouterr()
    assert "promoted demo" in captured.out and "refused: dirty" in captured.err
