"""Every system's headline benchmark in one list, and the runner behind ``make bench``.

``SUITE`` names, per result, the system, the module, the full arguments (those
that made the cited result, with at least 3 rounds) and the quick arguments
(smaller: fewer requests and rounds). A new system adds one :class:`Entry`.

``python -m benchmarks.suite --quick`` (``make bench``) runs the quick version
of every headline entry (about 20 minutes on 2 cores) into
``benchmarks/out/quick/`` and prints one summary table. Quick numbers are a
smoke test of the whole chain, not the headline results.
``python -m benchmarks.suite --full --system leap`` (``make bench-leap``) runs
a system's full headline entries into ``benchmarks/out/``; naming results
instead (``python -m benchmarks.suite --full leap_replay``) runs those.
``python -m benchmarks.promote NAME`` then publishes a clean run.
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import shlex
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

OUT = Path("benchmarks/out")
QUICK_OUT = OUT / "quick"
MIN_ROUNDS = 3
QUICK_NOTE = (
    "QUICK MODE: smaller runs (fewer requests, prompts and rounds) on whatever else this machine "
    "is doing. These numbers check that every benchmark runs end to end; they are NOT the "
    "headline results (`make bench-<system>` runs those, `benchmarks/results/` holds them)."
)
_OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}


_OF = {
    "ratio": lambda h: h["ratio"],
    "ours": lambda h: h["ours"],
    "ours - baseline": lambda h: h["ours"] - h["baseline"],
}


@dataclasses.dataclass(frozen=True)
class Goal:
    """The headline's target as a rule on one of its values (default: the ratio)."""

    op: str
    value: float
    of: str = "ratio"

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"goal operator {self.op!r} not in {sorted(_OPS)}")
        if self.of not in _OF:
            raise ValueError(f"goal on {self.of!r}; choose from {sorted(_OF)}")

    def met(self, headline: dict[str, Any]) -> bool | None:
        """Whether ``headline`` meets the goal; None when the value is missing."""
        try:
            value = _OF[self.of](headline)
        except TypeError:  # a None ratio (baseline 0)
            return None
        return None if value is None else bool(_OPS[self.op](value, self.value))

    def __str__(self) -> str:
        return f"{self.of} {self.op} {self.value:.3g}"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One benchmark result the suite can regenerate.

    ``full``: the arguments of the cited result (``--out`` is added by the
    runner); ``quick``: a smaller run for ``make bench``, None to leave the
    entry out of it. ``headline``: ``make bench-<system>`` runs it. ``minutes``:
    expected (quick, full) minutes on 2 cores, for the progress bar (quick: measured
    on a nearly idle machine, a cold LEAP recording included; full: estimates).
    ``min_rounds``: rounds a promoted headline needs (1 for a deterministic
    simulation). ``note``: how ``full`` differs from the command that made the
    result now in ``benchmarks/results/``, if at all.
    """

    system: str
    name: str
    module: str
    full: tuple[str, ...]
    quick: tuple[str, ...] | None
    goal: Goal
    minutes: tuple[float, float]
    headline: bool = True
    min_rounds: int = MIN_ROUNDS
    note: str = ""

    def args(self, quick: bool) -> tuple[str, ...]:
        if quick and self.quick is None:
            raise ValueError(f"{self.name} has no quick mode")
        return self.quick if quick else self.full

    def command(self, quick: bool, out: Path) -> list[str]:
        """``python -m <module> <args> --out <out>``."""
        return ["python", "-m", self.module, *self.args(quick), "--out", str(out)]


def _args(text: str) -> tuple[str, ...]:
    return tuple(shlex.split(text))


_LEAP_HEAD = "leap_sharegpt_512_cal512_next_step_x2"
_LEAP_RATES = "leap_sharegpt_512_cal512_rates"
_LEAP_512 = "--max-tokens 512 --dtype float32 --calibration 512 --drift 32"
# quick traces and saved runs apart from the full ones (histate.engine --reuse reads that folder)
_QUICK_TRACES = "tmp/histate_traces_quick"
_REPEATS_NOTE = "the cited run had --repeats {}; 3 rounds now"
_ACCT_CK = "~/.cache/vllm_ext/acct"
_TVQ_QUICK_WORK = "benchmarks/out/quick/tvq_work"

SUITE: tuple[Entry, ...] = (
    Entry(
        system="suite",
        name="fcfs_sharegpt",
        module="benchmarks.fcfs_sharegpt",
        full=_args("--rates 1,4,inf --requests 32 --max-tokens 64 --repeats 3"),
        quick=_args("--rates inf --requests 16 --max-tokens 64 --repeats 1"),
        goal=Goal(">=", 0.97),
        minutes=(1.5, 12),
        note=_REPEATS_NOTE.format(2),
    ),
    Entry(
        system="leap",
        name=_LEAP_HEAD,
        module="benchmarks.leap",
        full=_args(
            f"{_LEAP_512} --rates inf --variants leap_next_step --repeats 3 --name {_LEAP_HEAD}"
        ),
        quick=_args(
            "--max-tokens 128 --dtype float32 --calibration 64 --drift 8 --requests 16 "
            f"--rates inf --variants leap --repeats 1 --name {_LEAP_HEAD}"
        ),
        goal=Goal("<=", 0.75),
        minutes=(7, 90),
        note=_REPEATS_NOTE.format(2) + " (the name keeps its x2)",
    ),
    Entry(
        system="histate",
        name="histate_sim",
        module="benchmarks.histate.sim",
        full=_args("--seeds 0,1,2"),
        quick=_args(f"--quick --seeds 0,1,2 --trace-dir {_QUICK_TRACES}"),
        goal=Goal("<=", 1 / 3),
        minutes=(3, 25),
        min_rounds=3,  # deterministic, but one round per trace seed
    ),
    Entry(
        system="histate",
        name="histate_policies",
        module="benchmarks.histate.policies",
        full=(),
        quick=_args("--quick"),
        goal=Goal("<=", 1 / 1.2),
        minutes=(2, 20),
        headline=False,  # make bench-histate keeps its two; run it by name
        min_rounds=1,  # deterministic: seeded traces, counts
    ),
    Entry(
        system="histate",
        name="histate_engine",
        module="benchmarks.histate.engine",
        full=_args("--scenarios agentic12_host12M --repeats 3"),
        quick=_args(f"--quick --scenarios agentic12_host12M --trace-dir {_QUICK_TRACES}"),
        goal=Goal("<=", 1 / 1.5),
        minutes=(7, 40),
    ),
    Entry(
        system="flide",
        name="flide",
        module="benchmarks.flide",
        # the cited run: 4 points (the whole grid, --questions 4,16,64,256 --contexts
        # 512,1024,4096, is not yet measured); promote refuses --quick runs
        full=_args("--questions 16,64 --contexts 512,1024 --repeats 3"),
        quick=_args("--quick --repeats 1"),
        goal=Goal(">=", 9.5),
        minutes=(1, 2),
        note="the whole grid: --questions 4,16,64,256 --contexts 512,1024,4096",
    ),
    Entry(
        system="memx",
        name="memx",
        module="benchmarks.memx",
        full=_args("--repeats 3 --seeds 20"),
        quick=_args("--quick"),
        goal=Goal(">=", 10.0),  # configs/s vs the paper's 31,240 in 26.5 s
        # full: 14 min wall measured on the shared 2-core host (3 searches + 2 simulator passes)
        minutes=(1, 14),
    ),
    Entry(
        system="leap",
        name=_LEAP_RATES,
        module="benchmarks.leap",
        full=_args(
            f"{_LEAP_512} --rates 0.12,0.2 --variants leap --repeats 3 --name {_LEAP_RATES}"
        ),
        quick=None,
        goal=Goal("<=", 0.75),
        minutes=(0, 150),
        headline=False,
        note=_REPEATS_NOTE.format(1),
    ),
    Entry(
        system="leap",
        name="leap_sched_overhead",
        module="benchmarks.leap.sched_overhead",
        full=(),
        quick=None,
        goal=Goal("<", 0.043, of="ours - baseline"),  # extra ms < 1% of a 4.3 ms GPU step
        minutes=(0, 20),
        headline=False,
    ),
    Entry(
        system="leap",
        name="leap_replay",
        module="benchmarks.leap.replay",
        full=(),
        quick=None,
        goal=Goal("<=", 1.15),
        minutes=(0, 10),
        headline=False,
        min_rounds=1,
        note=f"replays the recording made by {_LEAP_HEAD} (same prompts and settings)",
    ),
    Entry(
        system="leap",
        name="leap_heads",
        module="benchmarks.leap.heads",
        full=(),
        quick=None,
        goal=Goal(">=", 0.7, of="ours"),  # the tau the replay needs for LEAP within 15%
        minutes=(0, 10),
        headline=False,
        min_rounds=1,
        note=f"reads the recording made by {_LEAP_HEAD}",
    ),
    Entry(
        system="acct",
        name="acct",
        module="benchmarks.acct",
        full=_args("speed --contexts 1024,2048,4096,8192 --rounds 3"),
        quick=_args("speed --contexts 512,1024 --rounds 1"),
        goal=Goal(">=", 6.5),
        minutes=(0.5, 25),
    ),
    Entry(
        system="acct",
        name="acct_quality",
        module="benchmarks.acct",
        # the checkpoints: `python -m vllm_ext.acct train` (docs/acct.md, Results)
        full=_args(
            f"quality --checkpoint kl256={_ACCT_CK}/ck_kl:256 --checkpoint "
            f"ridge256={_ACCT_CK}/ck_ridge:256 --checkpoint kl={_ACCT_CK}/ck_kl "
            f"--checkpoint ridge={_ACCT_CK}/ck_ridge --windows 2 --context 1024 "
            "--continuation 64 --needles 8"
        ),
        # the identity import needs no trained checkpoint: the chain end to end
        quick=_args("quality --checkpoint id=identity --windows 1 --context 512 --continuation 32"),
        goal=Goal("<=", 1.01),
        minutes=(1, 10),
        min_rounds=1,  # deterministic: no timing
        note="2 windows + 8 needles of 1024 tokens (load average 20-28 on 2 cores)",
    ),
    Entry(
        system="acct",
        name="acct_compressed",
        module="benchmarks.acct",
        full=_args("compressed --context 2048 --continuation 64 --train 6 --windows 4"),
        quick=_args("compressed --context 256 --continuation 16 --train 1 --windows 1"),
        goal=Goal("<=", 1.01),
        minutes=(1, 15),
        headline=False,
        min_rounds=1,  # deterministic: no timing
        note="promoted with 3 training + 2 held-out windows, 32-token continuation (shared cores)",
    ),
    Entry(
        system="ark",
        name="ark_sim",
        module="benchmarks.ark.sim",
        full=(),
        quick=_args("--quick"),
        goal=Goal("<=", 0.727),  # mean FCT >= 27.3 % lower than random ports (the paper)
        minutes=(0.5, 25),
        min_rounds=1,  # deterministic; its 3 seeds are fixed in the module
    ),
    Entry(
        system="ark",
        name="ark_testbed",
        module="benchmarks.ark.testbed",
        full=_args("--rounds 3"),
        quick=_args("--rounds 1 --requests 8"),
        goal=Goal("<=", 0.73),  # random/ARK >= 1.37
        minutes=(1, 10),
    ),
    Entry(
        system="ark",
        name="ark_nixl_testbed",
        module="benchmarks.ark.nixl_testbed",
        full=_args("--rounds 3"),
        quick=None,  # needs root and nixl (not a declared dependency)
        goal=Goal("<", 1.0),  # lower mean FCT than random ports; ark_testbed holds the target
        minutes=(2, 5),
        headline=False,
    ),
    Entry(
        system="tvq",
        name="tvq",
        module="benchmarks.tvq.quality",
        full=_args(
            "--bits 3 --rtn-bits 4,3,2 --steps 12 --batch 1 --eval-every 6 --relookup-every 6 "
            "--eval-chunks 2 --refine-steps 4 --rtn-groups row --export"
        ),
        quick=_args(
            "--base tiny-llama --bits 3 --steps 2 --eval-every 1 --eval-chunks 1 --calib-chunks 1 "
            f"--refine-steps 2 --rtn-groups row --export --work {_TVQ_QUICK_WORK}"
        ),
        goal=Goal("<=", 1 / 1.2),  # layer-wise VQ / TVQ perplexity >= 1.2 at 3 bits
        minutes=(1.5, 60),
        # deterministic (seeded init and training, fixed held-out tokens); one training run
        # is most of an hour on the shared 2-core host
        min_rounds=1,
    ),
    Entry(
        system="tvq",
        name="tvq_kernel",
        module="benchmarks.tvq.decode",
        # the checkpoint is the one the tvq entry above exports (it runs first)
        # the plain VQ checkpoint of the same format (speed does not depend on the code values):
        # python -m vllm_ext.tvq --threads 1 train --out benchmarks/out/tvq_dec --steps 0
        #   --vec-dim 2 --num-codewords 64 --calib-chunks 1 --skip-eval
        full=_args(
            "--ckpt benchmarks/out/tvq_dec/ckpt --rounds 3 --tokens 16 --variants bf16,tvq_kernel"
        ),
        quick=_args(f"--ckpt {_TVQ_QUICK_WORK}/tvq3/ckpt --base tiny-llama --rounds 1 --tokens 8"),
        goal=Goal(">=", 1.0),
        minutes=(1.5, 15),
    ),
    Entry(
        system="etaps",
        name="etaps",
        module="benchmarks.etaps.quality",
        full=(),  # 5 stages x (1 calibration + 2 training blocks) x 256 tokens, 2x512 held out
        quick=_args(
            "--sparsities 0.5,0.7 --train-steps 1 --block-len 64 --eval-blocks 1 --eval-len 128"
        ),
        goal=Goal("<=", 1 / 1.3),  # ETAPS perplexity 1.3x lower than the best one-shot pruner
        minutes=(1.5, 45),  # full: 40 min before the ADMM baseline, which adds about 5
        min_rounds=1,  # deterministic: seeded, no timing
    ),
    Entry(
        system="etaps",
        name="etaps_kernel",
        module="benchmarks.etaps.kernel",
        full=_args("--rounds 3"),
        quick=_args("--sparsities 0.9 --rounds 1 --tokens 8"),
        goal=Goal(">=", 1.5),
        minutes=(2, 10),
    ),
)


def by_name(name: str) -> Entry | None:
    return next((e for e in SUITE if e.name == name), None)


def systems() -> list[str]:
    return sorted({e.system for e in SUITE})


def select(quick: bool, system: str | None = None, names: Sequence[str] = ()) -> list[Entry]:
    """Entries to run: those named, else the system's (or every) headline entry."""
    if names:
        unknown = [n for n in names if by_name(n) is None]
        if unknown:
            raise ValueError(f"unknown results {unknown}; known: {[e.name for e in SUITE]}")
        chosen = [e for e in SUITE if e.name in names]
    else:
        if system is not None and system not in systems():
            raise ValueError(f"unknown system {system!r}; known: {systems()}")
        chosen = [e for e in SUITE if e.headline and system in (None, e.system)]
    if quick:
        missing = [e.name for e in chosen if e.quick is None]
        if missing:
            raise ValueError(f"{missing} have no quick mode; run them with --full")
    return chosen


def describe(entries: Iterable[Entry]) -> str:
    """Every entry's full and quick command line (for README and reviewers)."""
    lines = []
    for e in entries:
        how = (
            f"make bench-{e.system}"
            if e.headline
            else f"python -m benchmarks.suite --full {e.name}"
        )
        lines.append(f"{e.system} / {e.name} (target {e.goal}; {how})")
        lines.append(f"  full:  {shlex.join(e.command(False, OUT))}  (~{e.minutes[1]:g} min)")
        if e.quick is not None:
            quick = shlex.join(e.command(True, QUICK_OUT))
            lines.append(f"  quick: {quick}  (~{e.minutes[0]:g} min)")
        if e.note:
            lines.append(f"  note:  {e.note}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small runs (the default)")
    mode.add_argument("--full", action="store_true", help="the headline runs, exact arguments")
    parser.add_argument("--system", choices=systems(), help="only this system's entries")
    parser.add_argument("names", nargs="*", help="results to run (default: headline entries)")
    parser.add_argument("--out", type=Path, help=f"default {QUICK_OUT} (quick), {OUT} (full)")
    parser.add_argument("--list", action="store_true", help="print the entries and exit")
    parser.add_argument(
        "--summary",
        action="store_true",
        help="only print the table of the results already in --out",
    )
    args = parser.parse_args(argv)
    quick = not args.full
    if args.list:
        sys.stdout.write(describe(SUITE))
        return 0
    try:
        entries = select(quick, args.system, args.names)
    except ValueError as exc:
        parser.error(str(exc))
    out = args.out or (QUICK_OUT if quick else OUT)
    if quick:
        sys.stdout.write(QUICK_NOTE + "\n")
    from benchmarks.suite_run import run, summary_rows, summary_table

    if args.summary:
        sys.stdout.write(summary_table(summary_rows(entries, out, {})))
        return 0
    start = time.monotonic()
    failed, seconds = run(entries, quick, out)
    table = summary_table(summary_rows(entries, out, failed))
    took = ", ".join(f"{name} {s / 60:.1f}" for name, s in seconds.items())
    footer = f"\nwall time {(time.monotonic() - start) / 60:.1f} min ({took} min)\n"
    text = (QUICK_NOTE + "\n\n" if quick else "") + table + footer
    (out / "summary.md").write_text(text, encoding="utf-8")
    sys.stdout.write("\n" + table + footer)
    if quick:
        sys.stdout.write(QUICK_NOTE + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
