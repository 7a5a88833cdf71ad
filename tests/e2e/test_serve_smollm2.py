"""`vllm-ext serve` starts a real `vllm serve` with SmolLM2 and an OpenAI client talks to it."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import SERVE_ARGS, assert_greedy_chat_reply, server_env
from vllm_ext.assets import model_path
from vllm_ext.serving import VllmServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "smollm2.log"
    with VllmServer(
        str(model_path("smollm2")),
        [*SERVE_ARGS, "--served-model-name", "smollm2"],
        launcher="vllm-ext",
        env=server_env(),
        log_path=log,
    ) as srv:
        yield srv


def test_chat_completion_answers(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    assert_greedy_chat_reply(client, "smollm2", model_path("smollm2"))


def test_sharegpt_trace_through_load_driver(server):
    from vllm_ext.bench.loadgen import Request, poisson_arrivals, run_trace_sync
    from vllm_ext.bench.stats import summarize
    from vllm_ext.datasets.sharegpt import first_turns

    samples = first_turns(6, seed=1, max_prompt_chars=400)
    arrivals = poisson_arrivals(len(samples), rate=4.0, seed=0)
    requests = [
        Request(
            id=s.id, messages=[{"role": "user", "content": s.prompt}], max_tokens=12, arrival_s=t
        )
        for s, t in zip(samples, arrivals, strict=True)
    ]
    records = run_trace_sync(server.base_url, "smollm2", requests, progress=False)
    assert [r.id for r in records] == [s.id for s in samples]
    assert all(r.ok for r in records), [r.error for r in records]
    assert all(r.output_tokens > 0 and r.ttft_s is not None for r in records)
    summary = summarize(records)
    assert summary["ok_count"] == 6 and summary["ttft_p50_s"] > 0


def test_metrics_endpoint_serves_vllm_metrics(server):
    text = server.get("/metrics")
    assert "vllm:prompt_tokens_total" in text
    assert "vllm:request_success_total" in text
