"""`vllm-ext serve --plugins flide`: the HTTP route classifies on a server that also chats.

One real server (tiny Qwen3-Next hybrid, multiprocess engine): the endpoint
plugin in the API server, the worker extension in the worker. Results equal
the same server's own ``prompt_logprobs`` on each context + question + label
alone; bad input is a 400 naming the problem, and the server keeps answering.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.e2e.conftest import SERVE_ARGS, server_env
from vllm_ext.assets import model_path
from vllm_ext.serving import VllmServer

LABELS = [" yes", " no", " definitely not"]
ITEM = {"context": "A cat sat on the warm mat all afternoon. " * 4,
        "questions": ["Did the cat sit?", {"id": "mat", "text": "Was the mat cold?"}]}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "flide.log"
    args = [*SERVE_ARGS, "--served-model-name", "tiny", "--plugins", "flide"]
    with VllmServer(
        str(model_path("tiny-hybrid")), args, launcher="vllm-ext", env=server_env(), log_path=log
    ) as srv:
        yield srv


def post(server, body) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(server.base_url + "/v1/flide/classify", data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_classify_returns_one_answer_per_question(server):
    status, body = post(server, {"labels": LABELS, "items": [ITEM]})
    assert status == 200, body
    results = body["results"]
    assert [r["id"] for r in results] == ["0.0", "mat"]
    for result in results:
        assert result["label"] in LABELS
        assert sum(result["probs"].values()) == pytest.approx(1.0)
        best = max(result["logprobs"], key=result["logprobs"].get)
        assert result["label"] == best
    assert body["usage"]["passes"] == 1


@pytest.mark.parametrize(
    "body, message",
    [
        ({"labels": LABELS, "items": []}, "non-empty list"),
        ({"labels": [" yes"], "items": [ITEM]}, "at least 2"),
        ({"labels": LABELS, "items": [{"context": "c", "questions": [{"id": "a", "text": "x"},
                                                                  {"id": "a", "text": "y"}]}]},
         "duplicate question id"),
        ({"labels": LABELS, "items": [{"context": "word " * 3000, "questions": ["q?"]}]},
         "exceeds max_model_len"),
        ({"labels": LABELS, "items": [ITEM], "temperature": 1}, "unknown key(s) 'temperature'"),
        ([LABELS, [ITEM]], "must be a JSON object"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_and_the_server_keeps_serving(server, body, message):
    status, reply = post(server, body)
    assert status == 400, reply
    assert message in reply["error"]["message"]
    ok, _ = post(server, {"labels": LABELS, "items": [ITEM]})
    assert ok == 200


def post_raw(server, data: bytes) -> int:
    req = urllib.request.Request(server.base_url + "/v1/flide/classify", data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_counters_on_metrics(server):
    from tests.e2e.conftest import metric_value

    rejected = "vllm_ext:flide_rejected_requests_total"
    post(server, {"labels": LABELS, "items": [ITEM]})
    before = metric_value(server.get("/metrics"), rejected) or 0.0
    # every kind of malformed request counts: a bad item, broken JSON, a non-object, a stray key
    assert post(server, {"labels": LABELS, "items": []})[0] == 400
    assert post_raw(server, b"{not json") == 400
    assert post(server, [LABELS])[0] == 400
    assert post(server, {"labels": LABELS, "items": [ITEM], "top_k": 3})[0] == 400
    text = server.get("/metrics")
    assert metric_value(text, "vllm_ext:flide_questions_total") >= 2
    assert metric_value(text, "vllm_ext:flide_passes_total") >= 1
    assert metric_value(text, "vllm_ext:flide_packed_tokens_total") > 0
    assert metric_value(text, rejected) == before + 4
    # labelled like vLLM's own metrics (and our other systems')
    assert 'vllm_ext:flide_questions_total{engine="0",model_name="tiny"}' in text


def test_the_same_server_still_generates(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


def test_http_results_equal_vllms_own_logprobs_on_each_question_alone(server):
    """Reference: the server's own /v1/completions ``prompt_logprobs`` on context+question+label."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path("tiny-hybrid")))
    status, body = post(server, {"labels": LABELS, "items": [ITEM]})
    assert status == 200, body
    context = tok.encode(ITEM["context"])
    for question, result in zip(["Did the cat sit?", "Was the mat cold?"], body["results"],
                                strict=True):  # fmt: skip
        for label in LABELS:
            label_ids = tok.encode(label, add_special_tokens=False)
            prompt = context + tok.encode(question, add_special_tokens=False) + label_ids
            req = urllib.request.Request(
                server.base_url + "/v1/completions",
                data=json.dumps(
                    {"model": "tiny", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}
                ).encode(),  # fmt: skip
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as resp:
                steps = json.loads(resp.read())["choices"][0]["prompt_logprobs"]
            start = len(prompt) - len(label_ids)
            ref = sum(steps[start + m][str(t)]["logprob"] for m, t in enumerate(label_ids))
            # bf16 hybrid: the documented tolerance of tests/engine/test_flide_engine.py
            assert result["logprobs"][label] == pytest.approx(ref, abs=0.05), (question, label)
