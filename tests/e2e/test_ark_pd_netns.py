"""ArkConnector P/D across the namespace leaf-spine: vLLM prefill on leaf 0, decode on leaf 1.

A 2-leaf / 2-spine fabric of network namespaces (``vllm_ext.ark.netns``, ``tc tbf`` links,
ECMP on the 5-tuple), a prefill ``vllm serve`` in host (0, 0), a decode ``vllm serve`` in host
(1, 0), the ARK proxy and the client in host (0, 1). The prefill instance plans its source
ports from a path map learned by probing the source leaf's FIB for each candidate port. Checked:
greedy answers through the proxy equal the prefill instance's own single-instance answers; the
KV of each request crossed the fabric on the spine the probed map gives for the data
connection's source port (the connection's ``bytes_acked`` from ``ss`` inside the prefill host
says which lane carried it; per-spine byte counters say where the bytes went: that spine
carried at least the KV's size, the other spine did not); two requests at once are planned onto
distinct spines; ARK's counters on both servers' /metrics. Needs root and ``ip netns``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import urllib.request

import numpy as np
import pytest

from tests.e2e.ark_pd import ark_kv_config, pd_behind_proxy, serving_in_thread
from tests.e2e.conftest import SERVE_ARGS, server_env, wait_for_metric
from vllm_ext.ark.netns import LeafSpine, host_ip, in_netns, netns_argv
from vllm_ext.ark.paths import LearnedMap, save_fabric_file
from vllm_ext.ark.proxy import serve
from vllm_ext.assets import model_path
from vllm_ext.serving import VllmServer


def _netns_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _netns_works(), reason="needs root and ip netns")

DATA_PORT, ANNOUNCE_PORT, PORT_BASE, PORT_COUNT = 7100, 7200, 41000, 8
CANDIDATES = tuple(range(PORT_BASE, PORT_BASE + PORT_COUNT))
PREFILL, DECODE, CLIENT = (0, 0), (1, 0), (0, 1)
DECODE_LEAF = DECODE[0]


class NsServer(VllmServer):
    """``vllm serve`` inside a host namespace, listening on that host's address."""

    def __init__(self, ns: str, address: str, model: str, args, **kwargs):
        super().__init__(model, [*args, "--host", address], **kwargs)  # the last --host wins
        self.ns, self.address = ns, address
        self.argv = netns_argv(ns, *self.argv)

    @property
    def base_url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def _healthy(self) -> bool:
        return in_netns(self.ns, super()._healthy)

    def get(self, path: str) -> str:
        return in_netns(self.ns, lambda: VllmServer.get(self, path))


def _kv_bytes_per_token(model: str) -> int:
    """K and V of every layer for one token, float32 (the dtype both servers run)."""
    cfg = json.loads((model_path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ark-netns")
    # the namespaces go away on exit, also when start-up or a test fails
    with LeafSpine(2, 2, 2, rate_mbit=200.0) as fabric:
        src, dst = host_ip(*PREFILL), host_ip(*DECODE)
        paths = LearnedMap()
        assert paths.learn(fabric.route_spine, src, dst, DATA_PORT, CANDIDATES) == PORT_COUNT
        assert set(paths.spines_of(src, dst, DATA_PORT).values()) == {0, 1}  # a real choice
        fabric_file = save_fabric_file(logs / "fabric.json", fabric.leaf_of_ip(),
                                       fabric.n_spines, paths)  # fmt: skip
        # no peers: the sender's view is its own announcements. The announced window starts
        # when a request is scheduled, before its prefill (seconds on 2 shared cores), so the
        # rate it is estimated with is set low enough for the window to cover prefill + send
        prefill_ark = {"host": src, "announce_port": ANNOUNCE_PORT, "port_base": PORT_BASE,
                       "port_count": PORT_COUNT, "fabric_file": str(fabric_file),
                       "link_gbps": 0.01}  # fmt: skip
        decode_ark = {"host": dst, "data_port": DATA_PORT, "load_timeout_s": 60.0}
        model = str(model_path("smollm2"))
        common = [*SERVE_ARGS, "--served-model-name", "smollm2", "--dtype", "float32"]
        # two servers on 2 cores: one unpinned OpenMP thread each, or their spin-waits collide
        env = {**server_env(), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}

        def make(where, role, ark):
            args = [*common, "--kv-transfer-config", ark_kv_config(role),
                    "--additional-config", json.dumps({"ark": ark})]  # fmt: skip
            return NsServer(fabric.host(*where), host_ip(*where), model, args, env=env,
                            log_path=logs / f"{role}.log", startup_timeout_s=600)  # fmt: skip

        servers = [make(PREFILL, "kv_producer", prefill_ark),
                   make(DECODE, "kv_consumer", decode_ark)]  # fmt: skip

        def start_proxy(prefill, decode):  # its socket and handler threads live in the client
            def start():
                return serving_in_thread(serve(host_ip(*CLIENT), 0, prefill.base_url,
                                               decode.base_url, (dst, DATA_PORT)))  # fmt: skip

            return in_netns(fabric.host(*CLIENT), start)

        with pd_behind_proxy(servers, start_proxy) as proxy:
            url = f"http://{host_ip(*CLIENT)}:{proxy.server_address[1]}"
            yield fabric, paths, *servers, url, []  # KV sizes of the transfers made


def _complete(fabric: LeafSpine, url: str, prompt: list[int]) -> list[str]:
    """A greedy completion sent from the client host."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "logprobs": 1}  # fmt: skip
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip

    def post():
        with urllib.request.urlopen(request, timeout=300) as resp:
            return json.loads(resp.read())

    reply = in_netns(fabric.host(*CLIENT), post)
    return reply["choices"][0]["logprobs"]["tokens"]


def _acked(fabric: LeafSpine) -> dict[int, int]:
    """``{source port: bytes acked}`` of the prefill host's connections to the KV listener."""
    out = subprocess.run(netns_argv(fabric.host(*PREFILL), "ss", "-Htin", "state", "established",
                                    f"( dport = :{DATA_PORT} )"),
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    acked, sport = {}, None
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[0].isdigit() and ":" in fields[2]:
            sport = int(fields[2].rsplit(":", 1)[1])
            acked.setdefault(sport, 0)
        match = re.search(r"\bbytes_acked:(\d+)", line)
        if match and sport is not None:
            acked[sport] = int(match.group(1))
    return acked


def _to_decode_leaf(fabric: LeafSpine) -> list[int]:
    return [spine[DECODE_LEAF] for spine in fabric.spine_tx_bytes()]


def _delta(after: dict | list, before: dict | list) -> dict[int, int]:
    keys = after.keys() if isinstance(after, dict) else range(len(after))
    old = before if isinstance(before, dict) else dict(enumerate(before))
    return {k: after[k] - old.get(k, 0) for k in keys}


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, size=int(k)).tolist() for k in rng.integers(100, 220, n)]


def test_concurrent_requests_are_planned_onto_distinct_spines(pd):
    fabric, paths, prefill, _, url, made = pd
    per_token = _kv_bytes_per_token("smollm2")
    prompts = _prompts(11, 2)
    alone = [_complete(fabric, prefill.base_url, p) for p in prompts]
    lanes0, spines0 = _acked(fabric), _to_decode_leaf(fabric)
    answers: list = [None, None]

    def ask(i):
        answers[i] = _complete(fabric, url, prompts[i])

    asks = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in asks:
        t.start()
    for t in asks:
        t.join()
    made += [len(p) * per_token for p in prompts]
    assert answers == alone
    lanes = _delta(_acked(fabric), lanes0)
    carried = _delta(_to_decode_leaf(fabric), spines0)
    kv = [len(p) * per_token for p in prompts]
    used = {port: n for port, n in lanes.items() if n >= min(kv)}
    assert set(used) <= set(CANDIDATES) and sum(used.values()) >= sum(kv), (lanes, kv)
    spines = {port: paths.spine(host_ip(*PREFILL), host_ip(*DECODE), port, DATA_PORT)
              for port in used}  # fmt: skip
    assert sorted(spines.values()) == [0, 1], (spines, lanes)  # one transfer per spine
    for port, spine in spines.items():  # where the probed map said, on the wire: one each
        assert used[port] <= carried[spine] < used[port] + min(kv), (carried, used, spines)


def test_each_transfer_crosses_the_spine_the_map_predicts(pd):
    fabric, paths, prefill, _, url, made = pd
    per_token = _kv_bytes_per_token("smollm2")
    for prompt in _prompts(7, 3):
        alone = _complete(fabric, prefill.base_url, prompt)  # same leaf: crosses no spine
        lanes0, spines0 = _acked(fabric), _to_decode_leaf(fabric)
        answer = _complete(fabric, url, prompt)
        made.append(len(prompt) * per_token)
        assert answer == alone
        lanes = _delta(_acked(fabric), lanes0)
        carried = _delta(_to_decode_leaf(fabric), spines0)
        kv = len(prompt) * per_token
        used = [port for port, n in lanes.items() if n >= kv]
        assert len(used) == 1 and used[0] in CANDIDATES, (lanes, kv)
        spine = paths.spine(host_ip(*PREFILL), host_ip(*DECODE), used[0], DATA_PORT)
        assert carried[spine] >= kv, (carried, spine, kv)
        assert carried[1 - spine] < kv / 10, (carried, spine, kv)  # a few kB of HTTP at most


def test_ark_counters_on_metrics(pd):
    fabric, _, prefill, decode, url, made = pd
    if not made:  # run alone: make one transfer
        prompt = _prompts(5, 1)[0]
        assert _complete(fabric, url, prompt) == _complete(fabric, prefill.base_url, prompt)
        made.append(len(prompt) * _kv_bytes_per_token("smollm2"))
    n = len(made)
    # a worker's counters reach /metrics with the stats of the engine's next step: one plain
    # request per server publishes those of the last transfer (an idle engine publishes nothing)
    for server in (prefill, decode):
        _complete(fabric, server.base_url, [1000, 2000, 3000])
    assert wait_for_metric(prefill, "vllm_ext:ark_planned_total", lambda v: v >= n) == n
    assert wait_for_metric(prefill, "vllm_ext:ark_transfers_sent_total", lambda v: v >= n) == n
    assert wait_for_metric(decode, "vllm_ext:ark_transfers_received_total",
                           lambda v: v >= n) == n  # fmt: skip
    sent = wait_for_metric(prefill, "vllm_ext:ark_transfer_bytes_total", lambda v: v >= sum(made))
    assert sent >= sum(made)  # whole blocks: at least the prompts' KV
    for server, name in ((prefill, "vllm_ext:ark_fallback_total"),
                         (prefill, "vllm_ext:ark_kept_port_total"),
                         (prefill, "vllm_ext:ark_bind_fallbacks_total"),
                         (decode, "vllm_ext:ark_load_timeouts_total")):  # fmt: skip
        assert wait_for_metric(server, name, lambda v: True, timeout_s=1.0) in (None, 0.0), name
