"""Counters a system keeps in EngineCore and in the worker reach `/metrics` of the API server.

The server is plain `vllm serve` with the connector passed by `--kv-transfer-config`
(module path), so this also checks that vLLM's own flags work without our launcher.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import SERVE_ARGS, server_env, wait_for_metric
from vllm_ext.assets import model_path
from vllm_ext.serving import VllmServer

KV_CONFIG = {
    "kv_connector": "CountingConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "tests.e2e.counting_connector",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "tiny-llama.log"
    args = [
        *SERVE_ARGS,
        "--served-model-name",
        "tiny",
        "--kv-transfer-config",
        json.dumps(KV_CONFIG),
    ]
    with VllmServer(
        str(model_path("tiny-llama")), args, launcher="vllm", env=server_env(), log_path=log
    ) as srv:
        yield srv


def test_scheduler_and_worker_counters_are_exported(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    for i in range(3):
        client.completions.create(model="tiny", prompt=f"count {i}", max_tokens=4, temperature=0)
    finished = wait_for_metric(
        server, "vllm_ext:testcount_requests_finished_total", lambda v: v >= 3
    )
    assert finished == 3.0
    steps = wait_for_metric(server, "vllm_ext:testcount_worker_steps_total", lambda v: v >= 12)
    assert steps is not None and steps >= 12  # ≥ 1 prefill + 3 decode steps per request
    help_text = server.get("/metrics")
    assert "# HELP vllm_ext:testcount_requests_finished_total requests finished" in help_text
