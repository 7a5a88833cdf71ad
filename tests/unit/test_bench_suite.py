"""``benchmarks.suite``: the list of headline benchmarks, what ``make bench`` runs, its table."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from benchmarks.suite import SUITE, Entry, Goal, by_name, describe, select
from benchmarks.suite_run import HEADER, summary_rows, summary_table
from vllm_ext.bench import BenchResult, headline_from_rounds, make_headline, write_result

pytestmark = pytest.mark.unit

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_goal_checks_the_headline_value_it_names() -> None:
    h = {"ratio": 0.7, "ours": 6.1, "baseline": 3.9}
    assert Goal("<=", 0.75).met(h) is True and Goal("<", 0.7).met(h) is False
    assert Goal(">=", 9.5).met({**h, "ratio": 6.5}) is False
    assert Goal("<", 0.043, of="ours - baseline").met(h) is False
    assert Goal(">=", 0.7, of="ours").met({**h, "ours": 0.38}) is False
    assert Goal("<=", 1.0).met({**h, "ratio": None}) is None
    assert str(Goal("<=", 1 / 3)) == "ratio <= 0.333"
    with pytest.raises(ValueError):
        Goal("=<", 1.0)
    with pytest.raises(ValueError):
        Goal("<", 1.0, of="speed")


def test_every_system_has_a_quick_headline_in_make_bench() -> None:
    quick = select(quick=True)
    systems = {"suite", "leap", "histate", "flide", "memx", "acct", "ark", "tvq", "etaps"}
    assert {e.system for e in quick} == systems
    assert {e.name for e in quick if e.system == "histate"} == {"histate_sim", "histate_engine"}
    assert all(e.headline and e.quick is not None for e in quick)
    # "about 20 minutes on 2 cores" when it had five systems; nine now, about 30
    assert sum(e.minutes[0] for e in quick) <= 30
    assert [e.name for e in select(False, "leap")] == ["leap_sharegpt_512_cal512_next_step_x2"]
    assert [e.name for e in select(False, names=["leap_replay"])] == ["leap_replay"]
    with pytest.raises(ValueError, match="no quick mode"):
        select(True, names=["leap_replay"])
    with pytest.raises(ValueError, match="unknown"):
        select(False, names=["nope"])
    with pytest.raises(ValueError, match="unknown system"):
        select(False, "nope")


def test_entries_name_kept_results_and_unique_names() -> None:
    names = [e.name for e in SUITE]
    assert len(names) == len(set(names))
    for name in names:
        assert (RESULTS / f"{name}.json").exists(), name
    assert by_name("flide").system == "flide" and by_name("nope") is None


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    path = Path(spec.origin)
    if path.name == "__init__.py":  # a package run with -m: its __main__
        path = path.with_name("__main__.py")
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("entry", SUITE, ids=lambda e: e.name)
def test_entry_arguments_are_options_of_its_module(entry: Entry) -> None:
    source = _source(entry.module)
    assert '"--out"' in source, entry.module  # the runner adds --out
    for args in (entry.full, entry.quick or ()):
        for flag in (a for a in args if a.startswith("--")):
            assert f'"{flag}"' in source, f"{entry.name}: {flag} not an option of {entry.module}"
    for args in (entry.full, entry.quick or ()):
        if "--name" in args:  # the file the summary reads is <name>.json
            assert args[args.index("--name") + 1] == entry.name


@pytest.mark.parametrize("entry", [e for e in SUITE if e.headline], ids=lambda e: e.name)
def test_full_runs_quote_enough_rounds(entry: Entry) -> None:
    if entry.min_rounds == 1:
        return  # deterministic: one round is the measurement
    args = " ".join(entry.full)
    if "flide" in entry.module:  # timed runs per point
        assert "--repeats 3" in args
    elif "histate.sim" in entry.module:  # deterministic: one round per trace seed
        assert re.search(r"--seeds \d+(,\d+){2,}", args), args
    elif "acct" in entry.module:  # paired timing rounds
        assert re.search(r"--rounds ([3-9]|\d\d)", args), args
    else:
        assert re.search(r"--(repeats|rounds) ([3-9]|\d\d)", args), args


def _result(out: Path, name: str, rounds: bool = True) -> None:
    if rounds:
        head = headline_from_rounds("x_s", [0.2, 0.1, 0.3], [0.4, 0.5, 0.3], "fcfs", False, "t")
    else:
        head = make_headline("x_s", 0.5, 2.0, "native", False, "t")
    result = BenchResult(
        name=name, description="d", variants={"a": {"x_s": 0.1}}, headline=head, fingerprint={}
    )
    write_result(result, out, plot=False)


def test_summary_table_one_row_per_entry(tmp_path) -> None:
    leap, sim, flide = by_name("leap_sharegpt_512_cal512_next_step_x2"), SUITE[2], by_name("flide")
    _result(tmp_path, leap.name)
    _result(tmp_path, sim.name, rounds=False)
    failed = {flide.name: "FAILED (exit 1, see log)"}
    rows = summary_rows([leap, sim, flide], tmp_path, failed)
    assert rows[0] == [
        "leap",
        leap.name,
        "x_s",
        "0.2 [0.1-0.3]",
        "0.4 [0.3-0.5] (fcfs)",
        "0.5",
        "ratio <= 0.75",
        "yes",
        "3",
    ]
    assert rows[1][3:] == ["0.5", "2 (native)", "0.25", "ratio <= 0.333", "yes", "-"]
    assert rows[2][:3] == ["flide", "flide", "FAILED (exit 1, see log)"]
    table = summary_table(rows)
    lines = table.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == HEADER
    assert len(lines) == 2 + len(rows) and len({len(line) for line in lines}) == 1
    assert "no result file" in summary_rows([flide], tmp_path, {})[0][2]


def test_describe_lists_full_and_quick_commands() -> None:
    text = describe(SUITE)
    assert "python -m benchmarks.fcfs_sharegpt --rates 1,4,inf" in text
    assert "--out benchmarks/out/quick" in text and "make bench-histate" in text


def test_runner_logs_each_entry_and_reports_failures(tmp_path) -> None:
    from benchmarks.suite_run import run

    ok = Entry("s", "lists", "benchmarks.suite", ("--list",), None, Goal("<", 1), (0, 0.01))
    bad = Entry(
        "s", "bad", "benchmarks.promote", ("--no-such-flag",), None, Goal("<", 1), (0, 0.01)
    )
    failed, seconds = run([ok, bad], quick=False, out=tmp_path)
    assert set(seconds) == {"lists", "bad"}
    assert list(failed) == ["bad"] and "exit 2" in failed["bad"]
    log = (tmp_path / "logs" / "lists.log").read_text()
    assert log.startswith("python -m benchmarks.suite --list --out ")
    assert "python -m benchmarks.fcfs_sharegpt" in log  # the entry's own output
    assert "unrecognized arguments" in (tmp_path / "logs" / "bad.log").read_text()
