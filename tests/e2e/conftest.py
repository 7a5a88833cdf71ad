"""Servers for the e2e tier: one ``vllm serve`` subprocess per module, on loopback."""

from __future__ import annotations

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
