"""Markdown table and PNG plot of a :class:`BenchResult`, and writing the three files.

This module depends on :mod:`vllm_ext.bench.results`, never the reverse.
matplotlib is imported lazily with the non-interactive ``Agg`` backend.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from vllm_ext.bench.fingerprint import fingerprint_summary
from vllm_ext.bench.results import BenchResult, dumps_result

# where runs write; ``python -m benchmarks.promote`` copies a clean run to benchmarks/results/
OUT_DIR = "benchmarks/out"

logger = logging.getLogger(__name__)


def _is_number(value: Any) -> bool:
    """True for int/float (not bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_value(value: Any) -> str:
    """Compact cell text: 4 significant digits for floats, '-' for None."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def numeric_metric_names(variants: dict[str, dict[str, Any]]) -> list[str]:
    """Metric names (first-seen order) that are numeric in some variant."""
    names: list[str] = []
    for metrics in variants.values():
        for key, value in metrics.items():
            if key not in names and (_is_number(value) or value is None):
                names.append(key)
    return [n for n in names if any(_is_number(m.get(n)) for m in variants.values())]


def with_spread(h: dict[str, Any], side: str) -> str:
    """``h[side]`` and, when measured over rounds, its ``[min-max]`` range."""
    text = format_value(h[side])
    lo_hi = h.get(f"{side}_spread")
    if lo_hi and h.get("rounds", 1) > 1:
        text += f" [{format_value(lo_hi[0])}-{format_value(lo_hi[1])}]"
    return text


def _rounds_text(h: dict[str, Any]) -> str:
    if "rounds" not in h:
        return ""
    text = f"; median of {h['rounds']} round{'s' if h['rounds'] != 1 else ''}"
    if h.get("ratio_spread") and h["rounds"] > 1:
        lo, hi = h["ratio_spread"]
        text += f", per-round ratio {format_value(lo)}-{format_value(hi)}"
    return text


def _headline_line(h: dict[str, Any]) -> str:
    """Markdown sentence describing the headline."""
    direction = "higher is better" if h["higher_is_better"] else "lower is better"
    ratio = format_value(h["ratio"])
    return (
        f"**Headline:** `{h['metric']}` ours {with_spread(h, 'ours')} vs "
        f"{h['baseline_name']} {with_spread(h, 'baseline')} -> ratio "
        f"{ratio}x ({direction}; target {format_value(h['target'])}{_rounds_text(h)})"
    )


def headline_text(h: dict[str, Any], ours_name: str = "ours") -> str:
    """One plain-text line for a benchmark's stdout: metric, both values, ratio, target."""
    return (
        f"{h['metric']}: {ours_name} {with_spread(h, 'ours')} vs {h['baseline_name']} "
        f"{with_spread(h, 'baseline')} (ratio {format_value(h['ratio'])}); "
        f"target {format_value(h['target'])}{_rounds_text(h)}\n"
    )


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    """Markdown table lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def render_markdown(result: BenchResult) -> str:
    """Markdown report: headline, variants x metrics table, series, host."""
    lines = [f"# {result.name}", "", result.description, "", _headline_line(result.headline), ""]
    metrics = numeric_metric_names(result.variants)
    rows = [
        [variant] + [format_value(m.get(k)) for k in metrics]
        for variant, m in result.variants.items()
    ]
    lines += _table(rows, ["variant", *metrics]) + [""]
    if result.series and result.sweep_axis:
        axis = result.sweep_axis
        for variant, points in result.series.items():
            cols = numeric_metric_names(dict(enumerate(points)))
            cols = [axis] + [c for c in cols if c != axis]
            lines += [f"## {variant} by {axis}", ""]
            lines += _table([[format_value(p.get(c)) for c in cols] for p in points], cols) + [""]
    lines += [f"_Environment:_ {fingerprint_summary(result.fingerprint)}", ""]
    if result.command:
        lines += [f"_Command:_ `{result.command}`", ""]
    power_line = _power_line(result.power)
    if power_line:
        lines += [power_line, ""]
    return "\n".join(lines)


def _power_line(power: dict[str, Any]) -> str:
    """One line per variant: median power fraction and SM clock fraction."""
    parts = []
    for variant, summary in (power or {}).items():
        if not isinstance(summary, dict) or not summary.get("available"):
            continue
        for gpu in summary.get("gpus", []):
            parts.append(
                f"{variant} GPU{gpu['index']}: power "
                f"{format_value(gpu['power_w']['p50'])} W = "
                f"{format_value(gpu['power_fraction_of_limit'])} of limit, SM clock "
                f"{format_value(gpu['sm_clock_fraction_of_max'])} of max"
            )
    return ("_GPU power (median):_ " + "; ".join(parts)) if parts else ""


def choose_plot_metric(result: BenchResult) -> str | None:
    """``plot_metric`` if set, else the headline metric, else the first
    numeric metric."""
    if result.plot_metric:
        return result.plot_metric
    metrics = numeric_metric_names(result.variants)
    if result.series:
        points = [p for pts in result.series.values() for p in pts]
        metrics = [
            m for m in numeric_metric_names(dict(enumerate(points))) if m != result.sweep_axis
        ]
    if result.headline["metric"] in metrics:
        return result.headline["metric"]
    return metrics[0] if metrics else None


def _axis_key(value: Any) -> float:
    # an infinite rate (a burst) is stored as null in JSON: it sorts last
    return float(value) if _is_number(value) else math.inf


def _plot_series(ax, series: dict, axis: str, metric: str) -> None:
    """One line per variant over the sweep points, on a categorical axis so that a
    burst (rate = inf, null in JSON) is drawn beside the finite rates."""
    points = sorted({_axis_key(p.get(axis)) for pts in series.values() for p in pts})
    labels = ["burst" if math.isinf(x) else f"{x:g}" for x in points]
    for variant, pts in series.items():
        by_x = {_axis_key(p.get(axis)): p.get(metric) for p in pts if _is_number(p.get(metric))}
        xs = [i for i, x in enumerate(points) if x in by_x]
        if xs:
            ax.plot(xs, [by_x[points[i]] for i in xs], marker="o", label=variant)
    ax.set_xticks(range(len(points)), labels)
    ax.set_xlabel(axis)
    ax.legend()


def render_plot(result: BenchResult, path: str | os.PathLike[str]) -> None:
    """Bar chart of the plot metric per variant, or one line per variant
    along ``sweep_axis`` when series exist."""
    import matplotlib  # lazy: slow import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = choose_plot_metric(result)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        if result.series and result.sweep_axis and metric:
            _plot_series(ax, result.series, result.sweep_axis, metric)
        elif metric:
            names = list(result.variants)
            values = [result.variants[n].get(metric) for n in names]
            ax.bar(names, [v if _is_number(v) else 0.0 for v in values])
            ax.set_xlabel("variant")
            if len(names) > 5:  # long variant names overlap side by side
                ax.tick_params(axis="x", labelrotation=30)
        ax.set_ylabel(metric or "")
        ax.set_title(f"{result.name}: {metric}")
        fig.tight_layout()
        fig.savefig(os.fspath(path))
    finally:
        plt.close(fig)


def write_result(
    result: BenchResult,
    out_dir: str | os.PathLike[str] = OUT_DIR,
    *,
    plot: bool = True,
) -> dict[str, Path]:
    """Write ``<name>.json``, ``<name>.md`` and ``<name>.png`` to ``out_dir``.

    Returns ``{"json": path, "md": path, "png": path}`` (no ``png`` when
    ``plot=False``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{result.name}.json", "md": out / f"{result.name}.md"}
    paths["json"].write_text(dumps_result(result), encoding="utf-8")
    paths["md"].write_text(render_markdown(result), encoding="utf-8")
    if plot:
        paths["png"] = out / f"{result.name}.png"
        render_plot(result, paths["png"])
    logger.info("wrote benchmark result %s to %s", result.name, out)
    return paths
