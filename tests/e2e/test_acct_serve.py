"""`vllm serve` with the AcctConnector: a long prompt's prefix is imported, the counters
reach `/metrics` in vLLM naming (identity import: exact, cheap to set up)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import SERVE_ARGS, server_env, wait_for_metric
from vllm_ext.assets import model_path
from vllm_ext.serving import VllmServer

KV_CONFIG = {
    "kv_connector": "AcctConnector",
    "kv_connector_module_path": "vllm_ext.acct.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
ACCT = {"acct": {"checkpoint": "identity", "min_prefix_tokens": 64, "check_tokens": 16,
                 "check_max_gap": 10.0}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "acct.log"
    args = [*SERVE_ARGS, "--served-model-name", "smollm2", "--dtype", "float32",
            "--block-size", "32", "--kv-transfer-config", json.dumps(KV_CONFIG),
            "--additional-config", json.dumps(ACCT)]  # fmt: skip
    with VllmServer(
        str(model_path("smollm2")), args, launcher="vllm", env=server_env(), log_path=log
    ) as srv:
        yield srv


def test_long_prompt_is_imported_and_counted(server):
    from openai import OpenAI

    from vllm_ext.datasets import first_turns

    prompt = next(s.prompt for s in first_turns(40, seed=3) if 1200 <= len(s.prompt) <= 2400)
    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert reply.choices[0].message.content
    imported = wait_for_metric(server, "vllm_ext:acct_imported_tokens_total", lambda v: v > 0)
    assert imported is not None and imported % 32 == 0 and imported >= 64
    seconds = wait_for_metric(server, "vllm_ext:acct_conversion_seconds_total", lambda v: v > 0)
    assert seconds is not None and seconds > 0
    text = server.get("/metrics")
    assert "# HELP vllm_ext:acct_gate_failures_total imports the online check rejected" in text
