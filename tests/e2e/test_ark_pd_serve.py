"""ArkConnector P/D end to end: a prefill and a decode ``vllm serve`` and the ARK proxy.

Greedy completions through the proxy equal the prefill instance's own
single-instance answers on random prompts, and the KV moved on ARK's data
connection from the port ARK's planner chose: the prefill host (127.0.0.1) and
the decode host (127.0.0.2) sit on two leaves of a fabric file whose path map
puts one candidate port on spine 1 and the others on spine 0, and a live peer
(an :class:`Announcer` in this process) announces a long elephant flow from the
same leaf on spine 0. Only the planner's choice sends every transfer from that
one port (seen with ``ss``); a random candidate would hit it 1 time in 8 per
transfer. Transfers are counted on both servers' /metrics (planned, never
fallback: that path is tests/unit/test_ark_announce.py's). A malformed
announcement is dropped and counted while the server keeps serving; a decode
request whose KV never comes is recomputed after ``load_timeout_s`` and still
answers the same, counted as a timeout.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time

import numpy as np
import pytest

from tests.e2e.ark_pd import ark_kv_config, pd_behind_proxy, serving_in_thread
from tests.e2e.conftest import SERVE_ARGS, metric_value, server_env, wait_for_metric
from vllm_ext.ark.announce import Announcer
from vllm_ext.ark.fabric import Transfer
from vllm_ext.ark.paths import LearnedMap, save_fabric_file
from vllm_ext.ark.proxy import serve
from vllm_ext.assets import model_path
from vllm_ext.serving import VllmServer, free_port

PORT_BASE, PORT_COUNT = 41000, 8
PREFILL_HOST, DECODE_HOST = "127.0.0.1", "127.0.0.2"
# the one candidate port whose path (in the fabric file) avoids the announced elephant flow
FREE_SPINE_PORT = PORT_BASE + 5


def _fabric_file(path, data_port: int) -> str:
    """Two leaves, two spines: ``FREE_SPINE_PORT`` goes over spine 1, the other candidates 0."""
    spines = {(PREFILL_HOST, DECODE_HOST, port, data_port): int(port == FREE_SPINE_PORT)
              for port in range(PORT_BASE, PORT_BASE + PORT_COUNT)}  # fmt: skip
    leaf_of = {PREFILL_HOST: 0, DECODE_HOST: 1, "10.9.0.1": 0, "10.9.1.1": 1}
    return str(save_fabric_file(path, leaf_of, 2, LearnedMap(spines)))


def _busy_peer(prefill_announce: tuple[str, int]) -> Announcer:
    """A live peer sender that announces a long flow leaf 0 -> leaf 1 on spine 0."""
    port = free_port()
    peer = Announcer(f"{PREFILL_HOST}:{port}", PREFILL_HOST, port,
                     {"{}:{}".format(*prefill_announce): prefill_announce})  # fmt: skip
    return peer.start()


def _announce_elephant(peer: Announcer) -> None:
    now = time.monotonic()
    peer.announce([Transfer("elephant", "10.9.0.1", "10.9.1.1", 10**12, now - 1, now + 1800,
                            50000, 1, spine=0)])  # fmt: skip


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ark-serve")
    data_port, announce_port = free_port(), free_port()
    peer = _busy_peer((PREFILL_HOST, announce_port))
    ark = {"data_port": data_port, "announce_port": announce_port, "port_base": PORT_BASE,
           "port_count": PORT_COUNT, "load_timeout_s": 4.0, "min_bytes": 0,
           "peers": ["{}:{}".format(*peer.address)],
           "fabric_file": _fabric_file(logs / "fabric.json", data_port)}  # fmt: skip
    common = [*SERVE_ARGS, "--served-model-name", "smollm2", "--dtype", "float32"]
    model = str(model_path("smollm2"))
    # two servers on 2 cores: one unpinned OpenMP thread each, or their spin-waits collide
    env = {**server_env(), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    hosts = {"kv_producer": PREFILL_HOST, "kv_consumer": DECODE_HOST}
    servers = [
        VllmServer(
            model,
            [*common, "--kv-transfer-config", ark_kv_config(role),
             "--additional-config", json.dumps({"ark": {**ark, "host": host}})],
            env=env,
            log_path=logs / f"{role}.log",
        )  # fmt: skip
        for role, host in hosts.items()
    ]

    def start_proxy(prefill, decode):
        kv = (DECODE_HOST, data_port)
        return serving_in_thread(serve("127.0.0.1", 0, prefill.base_url, decode.base_url, kv))

    # both servers start at once: start-up dominates this module's time on 2 cores
    try:
        with pd_behind_proxy(servers, start_proxy) as proxy:
            yield *servers, f"http://127.0.0.1:{proxy.server_address[1]}", ark, peer
    finally:
        peer.close()


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)


def _complete(url: str, prompt, **extra) -> list[str]:
    reply = _client(url).completions.create(
        model="smollm2", prompt=prompt, max_tokens=8, temperature=0, logprobs=1, extra_body=extra
    )
    return reply.choices[0].logprobs.tokens


def test_pd_answers_equal_one_instance_and_kv_moves_on_the_planned_port(pd):
    prefill, decode, proxy, ark, peer = pd
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40000, size=int(n)).tolist() for n in rng.integers(20, 300, 4)]
    for prompt in prompts:
        _announce_elephant(peer)  # fresh before each transfer (UDP; the prefill is up by now)
        assert _complete(proxy, prompt) == _complete(prefill.base_url, prompt)
    sent = wait_for_metric(prefill, "vllm_ext:ark_transfers_sent_total", lambda v: v >= 4)
    got = wait_for_metric(decode, "vllm_ext:ark_transfers_received_total", lambda v: v >= 4)
    assert sent == 4 and got == 4
    assert wait_for_metric(prefill, "vllm_ext:ark_transfer_bytes_total", lambda v: v > 0) > 0
    # every transfer was planned from the live view (none fell back, none kept its port) ...
    assert wait_for_metric(prefill, "vllm_ext:ark_planned_total", lambda v: v >= 4) == 4
    assert not metric_value(prefill.get("/metrics"), "vllm_ext:ark_fallback_total")
    assert not metric_value(prefill.get("/metrics"), "vllm_ext:ark_kept_port_total")
    # ... and the data connection to the decode listener left from the port off the busy spine
    out = subprocess.run(["ss", "-Htn", "state", "established", f"( dport = :{ark['data_port']} )"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    ports = {int(line.split()[2].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}
    assert ports == {FREE_SPINE_PORT}, out


def test_a_hostile_announcement_is_dropped_and_counted(pd):
    prefill, _, proxy, ark, _ = pd
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
    prefill, decode, _, _, _ = pd
    prompt = np.random.default_rng(3).integers(100, 40000, size=120).tolist()
    lost = {"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "never-sent"}}
    assert _complete(decode.base_url, prompt, **lost) == _complete(prefill.base_url, prompt)
    assert wait_for_metric(decode, "vllm_ext:ark_load_timeouts_total", lambda v: v >= 1) == 1
