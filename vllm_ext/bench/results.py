"""Benchmark result container, headline validation and JSON persistence.

Every benchmark writes ``benchmarks/results/<name>.json`` (stable, sorted,
reloadable with :func:`load_result`) plus a markdown table and a PNG plot
(see :mod:`vllm_ext.bench.report`). The JSON carries a ``headline`` with
exactly the keys in :data:`HEADLINE_KEYS`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RESULT_SCHEMA = 1
HEADLINE_KEYS = frozenset(
    {"metric", "ours", "baseline", "baseline_name", "ratio", "higher_is_better", "target"}
)
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


def validate_headline(headline: Mapping[str, Any]) -> None:
    """Raise ValueError unless ``headline`` has exactly the required keys
    with sensible types and a consistent ratio."""
    if not isinstance(headline, Mapping):
        raise ValueError("headline must be a mapping")
    keys = set(headline)
    missing, extra = HEADLINE_KEYS - keys, keys - HEADLINE_KEYS
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
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


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


def write_result(
    result: BenchResult,
    out_dir: str | os.PathLike[str] = "benchmarks/results",
    *,
    plot: bool = True,
) -> dict[str, Path]:
    """Write ``<name>.json``, ``<name>.md`` and ``<name>.png`` to ``out_dir``.

    Returns ``{"json": path, "md": path, "png": path}`` (no ``png`` when
    ``plot=False``).
    """
    from vllm_ext.bench.report import render_markdown, render_plot

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


def load_result(path: str | os.PathLike[str]) -> BenchResult:
    """Load a result written by :func:`write_result`."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return BenchResult.from_dict(data)
