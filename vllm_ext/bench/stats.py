"""Percentile helpers and per-request record summaries.

Records may be :class:`vllm_ext.bench.loadgen.RequestRecord` objects or
plain mappings with the same field names (``ok``, ``ttft_s``, ``latency_s``,
``output_tokens``, ``prompt_tokens``, ``cached_tokens``, ``itl_s``,
``start_s``, ``end_s``). Missing data yields ``None`` rather than NaN so that
results serialise to valid JSON.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def _clean(values: Iterable[Any]) -> list[float]:
    """Finite floats from ``values``, dropping None/NaN/inf."""
    out = []
    for v in values:
        if v is None or isinstance(v, bool):
            continue
        f = float(v)
        if math.isfinite(f):
            out.append(f)
    return out


def percentile(values: Iterable[Any], q: float) -> float | None:
    """``q``-th percentile (0..100, linear interpolation) or None if empty."""
    data = _clean(values)
    if not data:
        return None
    return float(np.percentile(np.asarray(data, dtype=np.float64), q))


def median(values: Iterable[Any]) -> float | None:
    """Median of the finite values or None if there are none."""
    return percentile(values, 50)


def mean(values: Iterable[Any]) -> float | None:
    """Arithmetic mean of the finite values or None if there are none."""
    data = _clean(values)
    return float(np.mean(data)) if data else None


def ratio(ours: float | None, baseline: float | None) -> float | None:
    """``ours / baseline``; None when either is missing or baseline is 0."""
    if ours is None or baseline is None or baseline == 0:
        return None
    return float(ours) / float(baseline)


def _get(rec: Any, key: str, default: Any = None) -> Any:
    """Field ``key`` of a record object or mapping."""
    if isinstance(rec, Mapping):
        return rec.get(key, default)
    return getattr(rec, key, default)


def _tpot(rec: Any) -> float | None:
    """Time per output token after the first: (latency-ttft)/(n-1)."""
    n, ttft, lat = (_get(rec, "output_tokens") or 0, _get(rec, "ttft_s"), _get(rec, "latency_s"))
    if n <= 1 or ttft is None or lat is None:
        return None
    return (lat - ttft) / (n - 1)


def _wall_time(records: Sequence[Any]) -> float | None:
    """Run wall time: last end minus first start over all records."""
    starts = _clean(_get(r, "start_s") for r in records)
    ends = _clean(_get(r, "end_s") for r in records)
    if not starts or not ends:
        return None
    return max(ends) - min(starts)


def _sum_or_none(values: Iterable[Any]) -> int | None:
    """Sum of non-None values, or None if every value is None."""
    present = [int(v) for v in values if v is not None]
    return sum(present) if present else None


def summarize(records: Sequence[Any], wall_time_s: float | None = None) -> dict[str, Any]:
    """Summary metrics of per-request records.

    Latency metrics use successful requests only. Throughput is successful
    output tokens divided by ``wall_time_s`` (default: last ``end_s`` minus
    first ``start_s``). Keys ending in ``_s`` are seconds.
    """
    ok = [r for r in records if _get(r, "ok", True)]
    ttft = [_get(r, "ttft_s") for r in ok]
    lat = [_get(r, "latency_s") for r in ok]
    tpot = [_tpot(r) for r in ok]
    itl = [x for r in ok for x in (_get(r, "itl_s") or [])]
    per_tok = [
        _get(r, "latency_s") / _get(r, "output_tokens")
        for r in ok
        if _get(r, "latency_s") is not None and _get(r, "output_tokens")
    ]
    out_tokens = sum(int(_get(r, "output_tokens") or 0) for r in ok)
    prompt_tokens = _sum_or_none(_get(r, "prompt_tokens") for r in ok)
    cached = _sum_or_none(_get(r, "cached_tokens") for r in ok)
    wall = wall_time_s if wall_time_s is not None else _wall_time(records)
    n = len(records)
    return {
        "count": n,
        "ok_count": len(ok),
        "error_count": n - len(ok),
        "error_rate": (n - len(ok)) / n if n else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": mean(ttft),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "latency_mean_s": mean(lat),
        "mean_per_token_latency_s": mean(per_tok),
        "output_tokens_total": out_tokens,
        "prompt_tokens_total": prompt_tokens,
        "cached_tokens_total": cached,
        "prefix_cache_hit_rate": ratio(cached, prompt_tokens),
        "wall_time_s": wall,
        "output_throughput_tok_per_s": ratio(out_tokens, wall) if wall else None,
        "request_throughput_req_per_s": ratio(len(ok), wall) if wall else None,
    }


def median_metrics(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-key median over repeated runs' metric dicts.

    Numeric keys get the median of the runs that report them (None if none
    do); non-numeric keys keep the first run's value. ``n_runs`` is added.
    """
    keys: list[str] = []
    for run in runs:
        keys.extend(k for k in run if k not in keys)
    out: dict[str, Any] = {}
    for key in keys:
        vals = [run.get(key) for run in runs]
        numeric = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numeric or all(v is None for v in vals):
            out[key] = median(numeric)
        else:
            out[key] = next(v for v in vals if v is not None)
    out["n_runs"] = len(runs)
    return out


def spread(values: Sequence[Any]) -> dict[str, Any]:
    """Median and spread of per-round values: ``n``, ``median``, ``min``, ``max``, ``q1``, ``q3``.

    Non-finite or missing values are dropped first; every statistic is None
    when nothing is left. A headline quotes the median with ``[min, max]``
    (with 3 rounds the quartiles say little more).
    """
    data = _clean(values)
    if not data:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None}
    return {
        "n": len(data),
        "median": percentile(data, 50),
        "min": min(data),
        "max": max(data),
        "q1": percentile(data, 25),
        "q3": percentile(data, 75),
    }
