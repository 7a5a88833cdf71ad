"""Direction-aware comparison of two benchmark result dicts.

``a`` is the reference (older) result and ``b`` the candidate. For every
variant present in both, every metric that is numeric in both is compared;
the metric's name gives its direction (see :func:`metric_direction`).
A change worse than ``threshold`` (relative) is flagged as a regression;
metrics of unknown direction are reported but never flagged. The headline
is compared with its own ``higher_is_better``, and fingerprint differences
(vLLM build, GPU, CPU, torch, ...) are listed because they explain changes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

from vllm_ext.bench.fingerprint import key_fields

logger = logging.getLogger(__name__)

_HIGHER = (
    "throughput",
    "/s",
    "_per_s",
    "per_sec",
    "hit_rate",
    "hit rate",
    "accuracy",
    "speedup",
    "goodput",
    "acceptance",
)
_LOWER_TOKENS = frozenset(
    {
        "latency",
        "ttft",
        "tpot",
        "itl",
        "e2el",
        "time",
        "error",
        "errors",
        "mae",
        "rmse",
        "duration",
        "ms",
    }
)


def metric_direction(name: str) -> str | None:
    """``"higher"``/``"lower"`` is better, or None when unknown.

    Higher-is-better substrings win (``output_throughput_tok_per_s``,
    ``questions/s``, ``prefix_cache_hit_rate``); then lower-is-better words
    (``ttft_p50_s``, ``error_rate``, ``wall_time_s``, ``mae``).
    """
    low = name.lower()
    if any(p in low for p in _HIGHER):
        return "higher"
    if _LOWER_TOKENS & set(re.split(r"[^a-z0-9]+", low)):
        return "lower"
    return None


@dataclasses.dataclass(frozen=True)
class Diff:
    """One compared value. ``rel_change = (b - a) / |a|``."""

    kind: str  # "metric", "series", "headline" or "fingerprint"
    variant: str | None
    metric: str
    a: Any
    b: Any
    rel_change: float | None = None
    direction: str | None = None
    regression: bool = False
    improvement: bool = False

    @property
    def status(self) -> str:
        """Short label for tables."""
        if self.kind == "fingerprint":
            return "differs"
        if self.regression:
            return "REGRESSION"
        if self.improvement:
            return "improved"
        return "ok" if self.direction else "unknown-direction"


def _is_number(value: Any) -> bool:
    """True for finite int/float (not bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rel_change(a: float, b: float) -> float:
    """(b - a) / |a|; +-inf when a is 0 and b is not."""
    if a == 0:
        return 0.0 if b == 0 else math.copysign(math.inf, b)
    return (b - a) / abs(a)


def _diff(
    kind: str,
    variant: str | None,
    metric: str,
    a: float,
    b: float,
    direction: str | None,
    threshold: float,
) -> Diff:
    """Build a Diff, flagging it when it moves the wrong way past threshold."""
    rel = _rel_change(a, b)
    worse = (
        rel < -threshold
        if direction == "higher"
        else rel > threshold
        if direction == "lower"
        else False
    )
    better = (
        rel > threshold
        if direction == "higher"
        else rel < -threshold
        if direction == "lower"
        else False
    )
    return Diff(kind, variant, metric, a, b, rel, direction, worse, better)


def _compare_metrics(
    kind: str,
    variant: str,
    ma: Mapping[str, Any],
    mb: Mapping[str, Any],
    threshold: float,
    directions: Mapping[str, str],
) -> list[Diff]:
    """Diffs over metrics numeric in both mappings."""
    out = []
    for key in ma:
        if key in mb and _is_number(ma[key]) and _is_number(mb[key]):
            direction = directions.get(key, metric_direction(key))
            out.append(
                _diff(kind, variant, key, float(ma[key]), float(mb[key]), direction, threshold)
            )
    return out


def _compare_series(
    a: Mapping[str, Any], b: Mapping[str, Any], threshold: float, directions: Mapping[str, str]
) -> list[Diff]:
    """Diffs over sweep points matched by their axis value."""
    axis = a.get("sweep_axis")
    if not axis or axis != b.get("sweep_axis"):
        return []
    out: list[Diff] = []
    sa, sb = a.get("series") or {}, b.get("series") or {}
    for variant in (v for v in sa if v in sb):
        pb = {p.get(axis): p for p in sb[variant]}
        for point in sa[variant]:
            other = pb.get(point.get(axis))
            if other is None:
                continue
            metrics = {k: v for k, v in point.items() if k != axis}
            for d in _compare_metrics("series", variant, metrics, other, threshold, directions):
                out.append(dataclasses.replace(d, metric=f"{axis}={point.get(axis)}/{d.metric}"))
    return out


def _compare_headline(ha: Mapping[str, Any], hb: Mapping[str, Any], threshold: float) -> list[Diff]:
    """Headline ours and ratio, using the headline's own direction."""
    if not ha or not hb or ha.get("metric") != hb.get("metric"):
        if ha or hb:
            return [
                Diff(
                    "headline",
                    None,
                    "metric",
                    ha.get("metric") if ha else None,
                    hb.get("metric") if hb else None,
                )
            ]
        return []
    direction = "higher" if hb.get("higher_is_better") else "lower"
    out = []
    for key in ("ours", "ratio"):
        if _is_number(ha.get(key)) and _is_number(hb.get(key)):
            out.append(
                _diff(
                    "headline",
                    None,
                    f"{hb['metric']}:{key}",
                    float(ha[key]),
                    float(hb[key]),
                    direction,
                    threshold,
                )
            )
    return out


def fingerprint_diffs(fa: Mapping[str, Any] | None, fb: Mapping[str, Any] | None) -> list[Diff]:
    """Key fingerprint fields that differ between two results."""
    ka, kb = key_fields(dict(fa or {})), key_fields(dict(fb or {}))
    return [Diff("fingerprint", None, k, ka[k], kb[k]) for k in ka if ka[k] != kb[k]]


def compare(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    threshold: float = 0.05,
    directions: Mapping[str, str] | None = None,
) -> list[Diff]:
    """All diffs between result dicts ``a`` (reference) and ``b``.

    ``directions`` overrides inferred metric directions
    (metric name -> "higher"/"lower").
    """
    if threshold < 0:
        raise ValueError("threshold must be >= 0")
    directions = directions or {}
    va, vb = a.get("variants") or {}, b.get("variants") or {}
    diffs: list[Diff] = []
    for variant in (v for v in va if v in vb):
        diffs += _compare_metrics(
            "metric", variant, va[variant], vb[variant], threshold, directions
        )
    diffs += _compare_series(a, b, threshold, directions)
    diffs += _compare_headline(a.get("headline") or {}, b.get("headline") or {}, threshold)
    diffs += fingerprint_diffs(a.get("fingerprint"), b.get("fingerprint"))
    missing = sorted(set(va) ^ set(vb))
    if missing:
        logger.info("variants present in only one result: %s", missing)
    return diffs


def regressions(diffs: list[Diff]) -> list[Diff]:
    """The flagged diffs."""
    return [d for d in diffs if d.regression]


def _cell(value: Any) -> str:
    """Table cell text."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def format_diffs(diffs: list[Diff]) -> str:
    """Plain-text table of diffs (regressions first, then the rest)."""
    rows = sorted(diffs, key=lambda d: (not d.regression, d.kind == "fingerprint"))
    header = ("status", "kind", "variant", "metric", "a", "b", "change")
    table = [header] + [
        (
            d.status,
            d.kind,
            d.variant or "-",
            d.metric,
            _cell(d.a),
            _cell(d.b),
            f"{d.rel_change:+.1%}"
            if d.rel_change is not None and math.isfinite(d.rel_change)
            else _cell(d.rel_change),
        )
        for d in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    n_reg = len(regressions(diffs))
    lines.append(f"{n_reg} regression(s) flagged")
    return "\n".join(lines)
