"""ArkConnector P/D end to end: a prefill and a decode ``vllm serve`` and the ARK proxy.

Greedy completions through the proxy equal the prefill instance's own
single-instance answers on random prompts; the KV moved on ARK's data
connection from a candidate source port (seen with ``ss``) and is counted on
both servers' /metrics; with its only peer silent the sender falls back to
random candidate ports, counted; a malformed announcement is dropped and
counted while the server keeps serving; a decode request whose KV never comes is recomputed
after ``load_timeout_s`` and still answers the same, counted as a timeout.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time

import numpy as np
import pytest

from tests.e2e.ark_pd import ark_kv_config, pd_behind_proxy, serving_in_thread
from tests.e2e.conftest import SERVE_ARGS, server_env, wait_for_metric
from vllm_ext.ark.proxy import serve
from vllm_ext.assets import model_path
from vllm_ext.serving import VllmServer, free_port

PORT_BASE, PORT_COUNT = 41000, 8


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ark-serve")
    data_port = free_port()
    # one configured peer that never answers: the prefill sender has no view and falls back
    ark = {"data_port": data_port, "announce_port": free_port(), "port_base": PORT_BASE,
           "port_count": PORT_COUNT, "load_timeout_s": 4.0,
           "peers": [f"127.0.0.1:{free_port()}"]}  # fmt: skip
    common = [*SERVE_ARGS, "--served-model-name", "smollm2", "--dtype", "float32",
              "--additional-config", json.dumps({"ark": ark})]  # fmt: skip
    model = str(model_path("smollm2"))
    # two servers on 2 cores: one unpinned OpenMP thread each, or their spin-waits collide
    env = {**server_env(), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    servers = [
        VllmServer(
            model,
            [*common, "--kv-transfer-config", ark_kv_config(role)],
            env=env,
            log_path=logs / f"{role}.log",
        )
        for role in ("kv_producer", "kv_consumer")
    ]

    def start_proxy(prefill, decode):
        kv = ("127.0.0.1", data_port)
        return serving_in_thread(serve("127.0.0.1", 0, prefill.base_url, decode.base_url, kv))

    # both servers start at once: start-up dominates this module's time on 2 cores
    with pd_behind_proxy(servers, start_proxy) as proxy:
        yield *servers, f"http://127.0.0.1:{proxy.server_address[1]}", ark


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)


def _complete(url: str, prompt, **extra) -> list[str]:
    reply = _client(url).completions.create(
        model="smollm2", prompt=prompt, max_tokens=8, temperature=0, logprobs=1, extra_body=extra
    )
    return reply.choices[0].logprobs.tokens


def test_pd_answers_equal_one_instance_and_kv_moves_on_a_planned_port(pd):
    prefill, decode, proxy, ark = pd
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40000, size=int(n)).tolist() for n in rng.integers(20, 300, 4)]
    for prompt in prompts:
        assert _complete(proxy, prompt) == _complete(prefill.base_url, prompt)
    sent = wait_for_metric(prefill, "vllm_ext:ark_transfers_sent_total", lambda v: v >= 4)
    got = wait_for_metric(decode, "vllm_ext:ark_transfers_received_total", lambda v: v >= 4)
    assert sent == 4 and got == 4
    assert wait_for_metric(prefill, "vllm_ext:ark_transfer_bytes_total", lambda v: v > 0) > 0
    # the persistent data connection(s) to the decode listener use candidate source ports
    out = subprocess.run(["ss", "-Htn", "state", "established", f"( dport = :{ark['data_port']} )"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    ports = {int(line.split()[2].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}
    assert ports and ports <= set(range(PORT_BASE, PORT_BASE + PORT_COUNT)), out
    assert wait_for_metric(prefill, "vllm_ext:ark_fallback_total", lambda v: v >= 4) == 4


def test_a_hostile_announcement_is_dropped_and_counted(pd):
    prefill, _, proxy, ark = pd
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"{not json", ("127.0.0.1", ark["announce_port"]))
    # the server keeps serving; its counters reach /metrics with the next engine steps
    prompt = np.random.default_rng(5).integers(100, 40000, size=50).tolist()
    assert _complete(proxy, prompt) == _complete(prefill.base_url, prompt)
    name = 'vllm_ext:ark_announcements_dropped_total{engine="0",model_name="smollm2",' \
           'reason="malformed"}'  # fmt: skip
    deadline = time.monotonic() + 30
    while name + " 1.0" not in prefill.get("/metrics") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert name + " 1.0" in prefill.get("/metrics")


def test_kv_that_never_arrives_is_recomputed_and_counted(pd):
    prefill, decode, _, _ = pd
    prompt = np.random.default_rng(3).integers(100, 40000, size=120).tolist()
    lost = {"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "never-sent"}}
    assert _complete(decode.base_url, prompt, **lost) == _complete(prefill.base_url, prompt)
    assert wait_for_metric(decode, "vllm_ext:ark_load_timeouts_total", lambda v: v >= 1) == 1
