"""Running suite entries and the one summary table (``benchmarks.suite`` holds the list).

Each entry runs as its own ``python -m`` process with its output in
``<out>/logs/<name>.log``; one progress bar advances with the entries'
expected minutes. The table is read back from the result JSONs.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm_ext.bench.report import format_value, with_spread

HEADER = ["system", "result", "metric", "ours", "baseline", "ratio", "target", "met?", "rounds"]


def summary_rows(entries: Iterable[Any], out: Path, failed: dict[str, str]) -> list[list[str]]:
    """One row per entry from its result JSON under ``out`` (or why there is none)."""
    rows = []
    for e in entries:
        path = out / f"{e.name}.json"
        if e.name in failed or not path.exists():
            why = failed.get(e.name, "no result file")
            rows.append([e.system, e.name, why, "-", "-", "-", str(e.goal), "-", "-"])
            continue
        h = json.loads(path.read_text(encoding="utf-8"))["headline"]
        met = e.goal.met(h)
        rows.append(
            [
                e.system,
                e.name,
                h["metric"],
                with_spread(h, "ours"),
                f"{with_spread(h, 'baseline')} ({h['baseline_name']})",
                format_value(h["ratio"]),
                str(e.goal),
                {True: "yes", False: "no", None: "-"}[met],
                str(h.get("rounds", "-")),
            ]
        )
    return rows


def summary_table(rows: list[list[str]]) -> str:
    """Markdown table with columns padded to line up in a terminal."""
    table = [HEADER, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in table
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + "\n"


def _run_one(entry: Any, quick: bool, out: Path, bar, done_s: float) -> tuple[int, float]:
    """Run one entry, its output into ``out/logs/<name>.log``; (exit code, seconds)."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, *entry.command(quick, out)[1:]]
    budget = 60 * entry.minutes[0 if quick else 1]
    start = time.monotonic()
    with open(logs / f"{entry.name}.log", "w", encoding="utf-8") as log:
        log.write(shlex.join(entry.command(quick, out)) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(1.0)
            # creep towards the entry's expected share, never past it
            bar.n = done_s + min(time.monotonic() - start, 0.97 * budget)
            bar.refresh()
    bar.n = done_s + budget
    bar.refresh()
    return proc.returncode, time.monotonic() - start


def run(entries: list[Any], quick: bool, out: Path) -> tuple[dict[str, str], dict[str, float]]:
    """Run ``entries`` in order with one progress bar; (failures by name, seconds by name)."""
    from tqdm import tqdm

    total = sum(60 * e.minutes[0 if quick else 1] for e in entries)
    failed, seconds, done = {}, {}, 0.0
    fmt = "{l_bar}{bar}| {elapsed} elapsed, ~{remaining} left"
    with tqdm(total=total, desc="bench", bar_format=fmt, file=sys.stderr) as bar:
        for entry in entries:
            bar.set_description(f"bench {entry.name}")
            code, seconds[entry.name] = _run_one(entry, quick, out, bar, done)
            done += 60 * entry.minutes[0 if quick else 1]
            if code != 0:
                failed[entry.name] = f"FAILED (exit {code}, see {out}/logs/{entry.name}.log)"
    return failed, seconds
