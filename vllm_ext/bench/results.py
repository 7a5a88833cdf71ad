"""Benchmark result container, headline validation and JSON persistence.

Every benchmark writes ``benchmarks/out/<name>.json`` (stable, sorted,
reloadable with :func:`load_result`) plus a markdown table and a PNG plot
(:func:`vllm_ext.bench.report.write_result`); ``python -m benchmarks.promote``
copies a clean run into ``benchmarks/results/``. The JSON carries a
``headline`` with the keys in :data:`HEADLINE_KEYS` and, when it was measured
over rounds, those in :data:`ROUND_KEYS` (:func:`headline_from_rounds`), the
command line that made it and every variant's resolved config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_ext.bench.provenance import current_command
from vllm_ext.bench.stats import spread

logger = logging.getLogger(__name__)

RESULT_SCHEMA = 2
HEADLINE_KEYS = frozenset(
    {"metric", "ours", "baseline", "baseline_name", "ratio", "higher_is_better", "target"}
)
# a headline measured over rounds also carries these (ours/baseline are then the medians)
ROUND_KEYS = frozenset(
    {"rounds", "ours_per_round", "baseline_per_round", "ours_spread", "baseline_spread"}
)
# present when ours and baseline ran in the same rounds (paired): the per-round ratio's range
PAIRED_KEYS = frozenset({"ratio_spread"})
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _is_number(value: Any) -> bool:
    """True for int/float (not bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def make_headline(
    metric: str,
    ours: float,
    baseline: float,
    baseline_name: str,
    higher_is_better: bool,
    target: Any = None,
) -> dict[str, Any]:
    """Build and validate a headline; ``ratio = ours / baseline``.

    ``target`` documents the goal (e.g. ``1.2`` for a 1.2x ratio, or a
    string); ``ratio`` is None when ``baseline`` is 0.
    """
    if not _is_number(ours) or not _is_number(baseline):
        raise ValueError("headline ours/baseline must be numbers")
    headline = {
        "metric": metric,
        "ours": float(ours),
        "baseline": float(baseline),
        "baseline_name": baseline_name,
        "ratio": float(ours) / float(baseline) if baseline else None,
        "higher_is_better": higher_is_better,
        "target": target,
    }
    validate_headline(headline)
    return headline


def headline_from_rounds(
    metric: str,
    ours_per_round: Sequence[float],
    baseline_per_round: Sequence[float],
    baseline_name: str,
    higher_is_better: bool,
    target: Any = None,
    *,
    paired: bool = True,
) -> dict[str, Any]:
    """A headline whose ours/baseline are the medians of per-round values, with their spread.

    ``paired``: round ``i`` of ours and of the baseline ran together (the same
    round of a round-robin), so the per-round ratios are meaningful and their
    range is stored as ``ratio_spread``. The ratio itself is the ratio of the
    medians.
    """
    ours_runs, base_runs = _numbers(ours_per_round, "ours"), _numbers(baseline_per_round, "base")
    ours, base = spread(ours_runs), spread(base_runs)
    headline = make_headline(
        metric, ours["median"], base["median"], baseline_name, higher_is_better, target
    )
    headline.update(
        rounds=len(ours_runs),
        ours_per_round=ours_runs,
        baseline_per_round=base_runs,
        ours_spread=[ours["min"], ours["max"]],
        baseline_spread=[base["min"], base["max"]],
    )
    if paired and len(ours_runs) == len(base_runs) and all(base_runs):
        ratios = [o / b for o, b in zip(ours_runs, base_runs, strict=True)]
        headline["ratio_spread"] = [min(ratios), max(ratios)]
    validate_headline(headline)
    return headline


def _numbers(values: Sequence[float], what: str) -> list[float]:
    out = [float(v) for v in values if _is_number(v) and math.isfinite(v)]
    if not out or len(out) != len(values):
        raise ValueError(f"{what} per-round values must be finite numbers, got {list(values)!r}")
    return out


def validate_headline(headline: Mapping[str, Any]) -> None:
    """Raise ValueError unless ``headline`` has the required keys (and, if measured
    over rounds, all of :data:`ROUND_KEYS` consistent with its medians), sensible
    types and a consistent ratio."""
    if not isinstance(headline, Mapping):
        raise ValueError("headline must be a mapping")
    keys = set(headline)
    missing = HEADLINE_KEYS - keys
    if keys & ROUND_KEYS:
        missing |= ROUND_KEYS - keys
    extra = keys - HEADLINE_KEYS - ROUND_KEYS - PAIRED_KEYS
    if missing or extra:
        raise ValueError(f"headline keys wrong: missing={sorted(missing)} extra={sorted(extra)}")
    if not isinstance(headline["metric"], str) or not headline["metric"]:
        raise ValueError("headline metric must be a non-empty string")
    if not isinstance(headline["baseline_name"], str) or not headline["baseline_name"]:
        raise ValueError("headline baseline_name must be a non-empty string")
    if not isinstance(headline["higher_is_better"], bool):
        raise ValueError("headline higher_is_better must be a bool")
    ours, base, ratio = headline["ours"], headline["baseline"], headline["ratio"]
    if not (_is_number(ours) and _is_number(base)):
        raise ValueError("headline ours/baseline must be numbers")
    if base and not (_is_number(ratio) and math.isclose(ratio, ours / base, rel_tol=1e-9)):
        raise ValueError(f"headline ratio {ratio!r} != ours/baseline {ours / base!r}")
    if "rounds" in headline:
        _validate_rounds(headline)


def _validate_rounds(h: Mapping[str, Any]) -> None:
    """Medians and spreads must be those of the stored per-round values."""
    if not isinstance(h["rounds"], int) or h["rounds"] != len(h["ours_per_round"]):
        raise ValueError(f"headline rounds {h['rounds']!r} != len(ours_per_round)")
    for side in ("ours", "baseline"):
        runs = h[f"{side}_per_round"]
        s = spread(runs)
        if not math.isclose(h[side], s["median"], rel_tol=1e-9):
            raise ValueError(f"headline {side} {h[side]!r} is not the median of {runs!r}")
        if list(h[f"{side}_spread"]) != [s["min"], s["max"]]:
            raise ValueError(f"headline {side}_spread is not [min, max] of {runs!r}")


@dataclasses.dataclass
class BenchResult:
    """Everything one benchmark run produced.

    ``variants`` maps a variant name (baseline or ours) to its metrics;
    ``series`` optionally maps a variant to per-point metric dicts along
    ``sweep_axis`` (e.g. one dict per request rate, each containing the
    axis key). ``power`` holds :class:`GpuPowerSampler` summaries.
    """

    name: str
    description: str
    variants: dict[str, dict[str, Any]]
    headline: dict[str, Any]
    fingerprint: dict[str, Any]
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    power: dict[str, Any] = dataclasses.field(default_factory=dict)
    series: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    sweep_axis: str | None = None
    plot_metric: str | None = None
    command: str | None = dataclasses.field(default_factory=current_command)
    variant_configs: dict[str, Any] = dataclasses.field(default_factory=dict)
    schema: int = RESULT_SCHEMA

    def __post_init__(self) -> None:
        """Validate name, variants, headline and series."""
        if not _NAME_RE.match(self.name):
            raise ValueError(f"result name {self.name!r} is not a safe file stem")
        if not self.variants:
            raise ValueError("a result needs at least one variant")
        validate_headline(self.headline)
        if self.series and not self.sweep_axis:
            raise ValueError("series given without sweep_axis")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN/inf become None, numpy scalars unwrapped)."""
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchResult:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (a result written
        before a key existed loads with its default, its command with None)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs.setdefault("command", None)
        kwargs.setdefault("schema", 1)
        return cls(**kwargs)


def _jsonable(obj: Any) -> Any:
    """Recursively convert to JSON-safe builtins."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        return [_jsonable(v) for v in items]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalar
        return _jsonable(obj.item())
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def dumps_result(result: BenchResult) -> str:
    """Stable JSON text (sorted keys, 2-space indent, trailing newline)."""
    return json.dumps(result.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"


def load_result(path: str | os.PathLike[str]) -> BenchResult:
    """Load a result written by :func:`vllm_ext.bench.report.write_result`."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return BenchResult.from_dict(data)
