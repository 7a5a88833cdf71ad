"""vLLM P/D through NIXL with ARK-planned ports: a prefill ``vllm serve`` (vLLM's
``NixlConnector``), a decode ``vllm serve`` (``ArkNixlConnector`` with the shim preloaded)
and the ARK proxy in ``--nixl`` mode, KV in host memory (``kv_buffer_device=cpu``), UCX
over TCP on loopback.

Greedy completions through the proxy equal the prefill instance's own answers on random
prompts; the decode worker's connections to the prefill side's UCX listener use exactly
the ports ARK's plan took from the path map (5, one per UCX worker of its NIXL agent: 4
threads' and the agent's own, covering the 4 spines of the map), and the KV bytes arrived
on those connections (``ss``). Both port ranges lie below the kernel's ephemeral range. Loopback has
no spines: the path map stands in for a probed one (the decode instance is named
``127.0.0.3`` in it), so this checks that planned ports reach the wire, not a path.
Skips when ``nixl`` is not importable (not a dependency: docs/ark.md says how to add it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.ark_pd import pd_behind_proxy, serving_in_thread
from tests.e2e.conftest import SERVE_ARGS, server_env
from vllm_ext.ark.config import load_ark_config
from vllm_ext.ark.nixl import listener_plans
from vllm_ext.ark.paths import LearnedMap, save_fabric_file
from vllm_ext.ark.proxy import serve
from vllm_ext.ark.shim import build, nixl_ucx_workers
from vllm_ext.assets import model_path
from vllm_ext.serving import VllmServer, free_port_block

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("nixl") is None,
        reason="nixl not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)",
    ),  # fmt: skip
    pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)"),
    pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler"),
]

PORT_COUNT, N_SPINES, DECODE_NAME = 16, 4, "127.0.0.3"
# the prefill's UCX_TCP_PORT_RANGE: its NIXL agent (num_threads=4) has 5 UCX workers, each a
# TCP listener from the range (UCX retries a busy range forever: with 4 ports the prefill
# worker hung at start-up); spare ports for one another process takes meanwhile. Both
# ranges and the side channels lie below the ephemeral range: the decode worker's own port-0
# listeners once took a planned port there, another socket a side-channel port
LISTENER_PORTS = 8


def _fabric_file(path: Path, port_base: int, listeners: range) -> Path:
    # each spine behind 4 of the 16 candidate ports, in a random order, per listener port
    rng = np.random.default_rng(11)
    paths = LearnedMap()
    for listener in listeners:
        spines = rng.permutation(np.repeat(np.arange(N_SPINES), PORT_COUNT // N_SPINES))
        for port, spine in zip(range(port_base, port_base + PORT_COUNT), spines, strict=True):
            paths.record("127.0.0.1", DECODE_NAME, listener, port, int(spine))
    return save_fabric_file(path, {"127.0.0.1": 0, DECODE_NAME: 1}, N_SPINES, paths)


def _kv(connector: str, role: str) -> str:
    config = {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu"}
    if connector == "ArkNixlConnector":
        config["kv_connector_module_path"] = "vllm_ext.ark.nixl"
    return json.dumps(config)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ark-nixl")
    port_base = free_port_block(PORT_COUNT)
    first = free_port_block(LISTENER_PORTS, port_base + PORT_COUNT)
    last = first + LISTENER_PORTS - 1
    side_channels = free_port_block(2, last + 1)  # NIXL's handshake listeners (ZMQ)
    fabric = _fabric_file(logs / "fabric.json", port_base, range(first, last + 1))
    ark = {"host": DECODE_NAME, "port_base": port_base, "port_count": PORT_COUNT,
           "nixl_listener_ports": f"{first}-{last}", "fabric_file": str(fabric)}  # fmt: skip
    nixl_dir = str(Path(importlib.util.find_spec("nixl").origin).parents[1])
    # two servers on 2 cores: one unpinned OpenMP thread each; UCX over TCP only (on one
    # host it would pick shared memory), NIXL's side channel on IPv4 loopback; the engine
    # core in the server's process, as in the other tests (passed in its own process too)
    env = {**server_env(), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo",
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], nixl_dir])
    common = [*SERVE_ARGS, "--served-model-name", "smollm2", "--dtype", "float32",
              "--additional-config", json.dumps({"ark": ark})]  # fmt: skip
    model = str(model_path("smollm2"))
    prefill = VllmServer(model, [*common, "--kv-transfer-config",
                                 _kv("NixlConnector", "kv_producer")],
                         env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channels),
                              "UCX_TCP_PORT_RANGE": f"{first}-{last}"},
                         log_path=logs / "prefill.log", startup_timeout_s=600)  # fmt: skip
    decode = VllmServer(model, [*common, "--kv-transfer-config",
                                _kv("ArkNixlConnector", "kv_consumer")],
                        env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channels + 1),
                             "LD_PRELOAD": str(build())},
                        log_path=logs / "decode.log", startup_timeout_s=600)  # fmt: skip

    def start_proxy(prefill, decode):
        return serving_in_thread(serve("127.0.0.1", 0, prefill.base_url, decode.base_url, None))

    with pd_behind_proxy([prefill, decode], start_proxy) as proxy:
        yield prefill, decode, f"http://127.0.0.1:{proxy.server_address[1]}", ark, logs


def _complete(url: str, prompt) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
    reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8,
                                      temperature=0, logprobs=1)  # fmt: skip
    return reply.choices[0].logprobs.tokens


def _connections(listeners: range) -> list[tuple[int, int, int]]:
    """(local port, remote port, bytes received) of established TCP connections to them."""
    out = subprocess.run(["ss", "-Htni", "state", "established", "dst", "127.0.0.1"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    conns = []
    for head, info, _ in re.findall(r"^(\S.*)\n((\s.*)?)$", out, re.MULTILINE):
        local, remote = (int(f.rsplit(":", 1)[1]) for f in head.split()[2:4])
        got = re.search(r"bytes_received:(\d+)", info)
        if remote in listeners:
            conns.append((local, remote, int(got.group(1)) if got else 0))
    return conns


def test_pd_through_nixl_equals_one_instance_on_planned_ports(pd):
    prefill, _, proxy, ark, _ = pd
    rng = np.random.default_rng(17)
    prompts = [rng.integers(100, 40000, size=int(n)).tolist() for n in rng.integers(20, 300, 3)]
    for prompt in prompts:
        assert _complete(proxy, prompt) == _complete(prefill.base_url, prompt)
    first, last = (int(p) for p in ark["nixl_listener_ports"].split("-"))
    conns = _connections(range(first, last + 1))
    candidates = range(ark["port_base"], ark["port_base"] + PORT_COUNT)
    ours = [c for c in conns if c[0] in candidates]  # the decode side's ends
    assert ours, conns
    (listener,) = {remote for _, remote, _ in ours}
    # the plan the decode worker made, recomputed from the same config and path map
    plans = listener_plans(load_ark_config(ark))
    expected = plans.ports("127.0.0.1", nixl_ucx_workers())[listener]
    assert sorted(local for local, _, _ in ours) == sorted(expected)
    assert len({plans.plans[listener].spines()[p] for p in expected}) == N_SPINES
    # the KV (SmolLM2, float32: 30 layers x 2 x 3 x 64 x 4 bytes = 46 KB per token) came in
    # on planned ports
    assert sum(nbytes for _, _, nbytes in ours) > 20 * 46_080
