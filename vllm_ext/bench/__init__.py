"""Benchmark harness: fingerprint, GPU power sampling, load generation,
statistics, result files (JSON + markdown + PNG) and result comparison.

Every benchmark runs its baselines and ours on the same requests in one run,
reports medians over rounds with their spread (:func:`headline_from_rounds`),
records its command line and each variant's resolved config, and writes
``benchmarks/out/<name>.json`` through :func:`write_result`
(``python -m benchmarks.promote`` copies a clean run to ``benchmarks/results/``).
Importing this package is cheap: vllm, torch, openai, pynvml, tqdm and
matplotlib are imported lazily where used.
"""

from __future__ import annotations

from vllm_ext.bench.compare import Diff, compare, format_diffs, metric_direction, regressions
from vllm_ext.bench.fingerprint import collect_fingerprint, fingerprint_summary, key_fields
from vllm_ext.bench.loadgen import (
    Request,
    RequestRecord,
    assign_arrivals,
    poisson_arrivals,
    run_trace,
    run_trace_sync,
)
from vllm_ext.bench.power import GpuPowerSampler
from vllm_ext.bench.provenance import command_line, scrub, serve_config
from vllm_ext.bench.report import OUT_DIR, headline_text, write_result
from vllm_ext.bench.results import (
    HEADLINE_KEYS,
    ROUND_KEYS,
    BenchResult,
    headline_from_rounds,
    load_result,
    make_headline,
    validate_headline,
)
from vllm_ext.bench.stats import (
    mean,
    median,
    median_metrics,
    percentile,
    ratio,
    spread,
    summarize,
)

__all__ = [
    "HEADLINE_KEYS",
    "OUT_DIR",
    "ROUND_KEYS",
    "BenchResult",
    "Diff",
    "GpuPowerSampler",
    "Request",
    "RequestRecord",
    "assign_arrivals",
    "collect_fingerprint",
    "command_line",
    "compare",
    "fingerprint_summary",
    "format_diffs",
    "headline_from_rounds",
    "headline_text",
    "key_fields",
    "load_result",
    "make_headline",
    "mean",
    "median",
    "median_metrics",
    "metric_direction",
    "percentile",
    "poisson_arrivals",
    "ratio",
    "regressions",
    "run_trace",
    "run_trace_sync",
    "scrub",
    "serve_config",
    "spread",
    "summarize",
    "validate_headline",
    "write_result",
]
