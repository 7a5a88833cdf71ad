"""`vllm-ext serve --plugins leap` with calibrated weights: answers, predicts, learns, exports.

One real server (SmolLM2, the ``leap-smollm2`` weights): the probe loader, the
LeapConnector, the LEAP scheduler and the counters on ``/metrics`` all run in
vLLM's own processes (API server, EngineCore, worker).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import (
    SERVE_ARGS,
    assert_greedy_chat_reply,
    metric_value,
    server_env,
    wait_for_metric,
)
from vllm_ext.assets import model_path
from vllm_ext.assets.leap_weights import weights_path
from vllm_ext.leap.runtime import HINT_KEY
from vllm_ext.serving import VllmServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "leap.log"
    leap = {"leap": {"weights_path": str(weights_path())}}
    args = [
        *SERVE_ARGS,
        "--served-model-name",
        "smollm2",
        "--plugins",
        "leap",
        "--additional-config",
        json.dumps(leap),
    ]
    with VllmServer(
        str(model_path("smollm2")), args, launcher="vllm-ext", env=server_env(), log_path=log
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")


def test_chat_completion_answers_and_returns_the_prediction(client):
    reply = assert_greedy_chat_reply(client, "smollm2", model_path("smollm2"))
    # vLLM 0.32 puts the connector's finish params into the (non-streaming) response
    info = (reply.model_extra.get("kv_transfer_params") or {}).get("leap")
    assert info is not None, reply.model_extra
    assert info["predicted_tokens"] is not None and info["predicted_tokens"] >= 1
    assert info["output_tokens"] == reply.usage.completion_tokens


def test_completion_carries_predicted_tokens(client):
    reply = client.completions.create(
        model="smollm2", prompt="Write a haiku about the sea.", max_tokens=12, temperature=0
    )
    info = reply.model_extra["kv_transfer_params"]["leap"]
    assert info["predicted_tokens"] >= 1
    assert info["output_tokens"] == reply.usage.completion_tokens


def _ask_concurrently(client, n: int = 6):
    """``n`` chat requests at once; odd ones carry a client length hint of ``4 + 6 * i``."""

    def ask(i: int):
        hint = {"vllm_xargs": {HINT_KEY: 4 + 6 * i}} if i % 2 else None
        return client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"Count from 1 to {3 + i}."}],
            temperature=0,
            max_tokens=24,
            extra_body=hint,
        )

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(ask, range(n)))


def test_concurrent_requests_with_and_without_length_hints(client):
    for reply in _ask_concurrently(client):
        assert reply.usage.completion_tokens > 0
        assert reply.model_extra["kv_transfer_params"]["leap"]["predicted_tokens"] >= 1


def test_a_length_hint_replaces_the_probe_prediction(client):
    replies = _ask_concurrently(client)
    hinted = [r.model_extra["kv_transfer_params"]["leap"]["predicted_tokens"] for r in replies]
    assert hinted[1::2] == [4 + 6 * i for i in range(1, 6, 2)]


def test_leap_counters_on_metrics(server, client):
    client.completions.create(model="smollm2", prompt="Hello", max_tokens=4, temperature=0)
    predictions = wait_for_metric(server, "vllm_ext:leap_predictions_total", lambda v: v > 0)
    assert predictions is not None and predictions > 0
    # present (learning needs EOS-stopped or under-predicted capped requests)
    text = server.get("/metrics")
    assert metric_value(text, "vllm_ext:leap_rls_updates_total") is not None
    assert "# HELP vllm_ext:leap_predictions_total" in text
