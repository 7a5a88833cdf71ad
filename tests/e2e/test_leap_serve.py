"""`vllm-ext serve --plugins leap` with calibrated weights: reorders, predicts, learns, exports.

One real server (SmolLM2, the ``leap-smollm2`` weights) with a single decode
slot (``--max-num-seqs 1``): the probe loader, the LeapConnector, the LEAP
scheduler and the counters on ``/metrics`` all run in vLLM's own processes
(API server, EngineCore, worker). With one slot, vLLM's FCFS must finish the
request that arrived first before it starts any other; LEAP must not.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import (
    SERVE_ARGS,
    assert_greedy_chat_reply,
    metric_value,
    server_env,
    wait_for_metric,
)
from vllm_ext.assets import leap_weights_path, model_path
from vllm_ext.leap.runtime import HINT_KEY
from vllm_ext.serving import VllmServer

# long enough that all three short requests reach the engine while it still has far more to
# go. The client sees the stream late on a busy machine (the API server shares two cores
# with EngineCore): with 320 tokens CI's engine had finished the long one before the first
# streamed token reached the test, so nothing was preempted (while the order still looked
# right, the long stream being read last)
LONG_TOKENS = 1200
SHORT_TOKENS = 8
RESUMED_TOKENS = 5  # streamed by the long request after the short ones finished


def _one_slot(args: list[str]) -> list[str]:
    i = args.index("--max-num-seqs")
    return [*args[:i], "--max-num-seqs", "1", *args[i + 2 :]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "leap.log"
    # no aging within the test: on a loaded machine a slow long request must not turn into
    # an aged one that goes first (max_wait_s is LEAP's bound against starvation)
    # and one LEAP preemption per short request: on a slow machine the three short requests
    # reach the engine one at a time, the long one resumes between them, and each arrival
    # preempts it again (with the default bound of 2 the third short one waited for the long)
    leap = {"weights_path": str(leap_weights_path()), "max_wait_s": 3600.0}
    leap = {"leap": {**leap, "experimental": {"max_preemptions": 3}}}
    args = [*_one_slot(SERVE_ARGS), "--served-model-name", "smollm2", "--plugins", "leap",
            "--additional-config", json.dumps(leap)]  # fmt: skip
    with VllmServer(
        str(model_path("smollm2")), args, launcher="vllm-ext", env=server_env(), log_path=log
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY")


def _counter(server, name: str) -> float:
    return metric_value(server.get("/metrics"), f"vllm_ext:leap_{name}_total") or 0.0


def test_short_requests_overtake_a_long_one_that_arrived_first(server, client):
    """The long request holds the only slot when three short ones arrive; they finish first.

    FCFS cannot do this: with one slot it runs the first arrival to its end. The
    long request says how long it is (a client hint, and it cannot stop early);
    the short ones say nothing: LEAP knows them only by their ``max_tokens`` and,
    once prefilled, by the probe's prediction.
    """
    preemptions = _counter(server, "preemptions")
    finished: list[str] = []
    lock = threading.Lock()
    started, shorts_done = threading.Event(), threading.Event()

    def done(name: str) -> None:
        with lock:
            finished.append(name)

    def long_request() -> int:
        """Tokens the long request streamed after the short ones had finished."""
        stream = client.completions.create(
            model="smollm2", prompt="Tell me a long story about the sea.", stream=True,
            max_tokens=LONG_TOKENS, temperature=0,
            extra_body={"min_tokens": LONG_TOKENS, "vllm_xargs": {HINT_KEY: LONG_TOKENS}},
        )  # fmt: skip
        after_shorts = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                started.set()
                after_shorts += shorts_done.is_set()
                # resumed after the shorts: enough evidence, and on a slow machine the other
                # ~1000 tokens would only cost minutes (the client disconnect aborts it)
                if after_shorts >= RESUMED_TOKENS:
                    break
        stream.close()
        done("long")
        return after_shorts

    def short_request(i: int) -> int:
        reply = client.completions.create(
            model="smollm2", prompt=f"Name a colour number {i}:", max_tokens=SHORT_TOKENS,
            temperature=0,
        )  # fmt: skip
        done(f"short{i}")
        return reply.usage.completion_tokens

    with ThreadPoolExecutor(4) as pool:
        long = pool.submit(long_request)
        assert started.wait(timeout=600), "the long request produced no token"
        shorts = [pool.submit(short_request, i) for i in range(3)]
        short_tokens = [s.result(timeout=600) for s in shorts]
        shorts_done.set()
        resumed_tokens = long.result(timeout=600)

    # first the mechanism: the overtaking went through LEAP's SRPT preemption of the running
    # request (an order read off the client's streams alone can come from a lagging stream)
    after = wait_for_metric(server, "vllm_ext:leap_preemptions_total", lambda v: v > preemptions)
    assert after is not None and after > preemptions, (after, finished)
    # under FCFS the long stream ends (all its tokens) before any short one is answered
    assert finished[-1] == "long", finished
    assert all(0 < n <= SHORT_TOKENS for n in short_tokens)
    assert resumed_tokens == RESUMED_TOKENS  # parked and resumed, not cut short


def test_chat_completion_answers_and_returns_the_prediction(client):
    reply = assert_greedy_chat_reply(client, "smollm2", model_path("smollm2"))
    # vLLM 0.32 puts the connector's finish params into the (non-streaming) response
    info = (reply.model_extra.get("kv_transfer_params") or {}).get("leap")
    assert info is not None, reply.model_extra
    assert info["output_tokens"] == reply.usage.completion_tokens
    # a probe prediction from the weights, not the clamp floor FCFS-with-no-probe would show
    assert info["predicted_tokens"] is not None and info["predicted_tokens"] > 1


def test_different_prompts_get_different_predictions(client):
    prompts = ["Hi", "Write a detailed essay on the history of Rome, chapter by chapter."]
    predicted = []
    for prompt in prompts:
        reply = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=4, temperature=0
        )
        info = reply.model_extra["kv_transfer_params"]["leap"]
        assert info["output_tokens"] == reply.usage.completion_tokens
        predicted.append(info["predicted_tokens"])
    # the probe reads each prompt: a constant (or absent) predictor gives one value
    assert predicted[0] != predicted[1], predicted


def test_a_length_hint_replaces_the_probe_prediction(client):
    def ask(i: int):
        hint = {"vllm_xargs": {HINT_KEY: 4 + 6 * i}} if i % 2 else None
        return client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": f"Count from 1 to {3 + i}."}],
            temperature=0, max_tokens=12, extra_body=hint,
        )  # fmt: skip

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, range(4)))
    predicted = [r.model_extra["kv_transfer_params"]["leap"]["predicted_tokens"] for r in replies]
    assert predicted[1::2] == [10, 22]
    assert all(p is not None and p >= 1 for p in predicted[0::2])


def test_a_request_that_stops_on_its_own_updates_the_head(server, client):
    updates = _counter(server, "rls_updates")
    error_sum = _counter(server, "abs_log_error_sum")
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=64, temperature=0,
    )  # fmt: skip
    # only a request that ended by itself tells the head its true length
    assert reply.choices[0].finish_reason == "stop", reply
    after = wait_for_metric(server, "vllm_ext:leap_rls_updates_total", lambda v: v > updates)
    assert after is not None and after > updates
    assert _counter(server, "abs_log_error_sum") > error_sum
    assert "# HELP vllm_ext:leap_predictions_total" in server.get("/metrics")
