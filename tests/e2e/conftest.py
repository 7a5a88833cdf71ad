"""Servers for the e2e tier: one ``vllm serve`` subprocess per module, on loopback."""

from __future__ import annotations

import re
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# small KV, no compilation: start-up in well under a minute on 2 cores
SERVE_ARGS = [
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    str(256 << 20),
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "8",
]


def server_env() -> dict[str, str]:
    # the counting connector is imported from tests/ inside EngineCore and worker
    return {"PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "INFO"}


def metric_value(text: str, name: str) -> float | None:
    """The first sample of counter ``name`` on a Prometheus text page."""
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def wait_for_metric(server, name, predicate, timeout_s=30.0) -> float | None:
    """Poll ``/metrics`` until ``predicate(value)``; connector stats arrive with stats pushes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric_value(server.get("/metrics"), name)
        if (value is not None and predicate(value)) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)
