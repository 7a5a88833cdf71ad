"""ArkNixlConnector's port hook with the real shim: the ports registered before a
handshake are the ones the connections opened after it use (checked with ``ss``);
without the shim preloaded nothing is applied and it says so. A NIXL transfer
itself needs the ``nixl`` package (not a dependency of this project): see docs/ark.md."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from vllm_ext.ark.shim import NIXL_THREADS, ShimPorts, build, nixl_ucx_workers, peer_ports
from vllm_ext.serving import free_port_block

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler"),
]

# what the decode worker does: the hook runs, then the "handshake" asks the peer's side
# channel (a control connection, kept ephemeral) and opens one connection per UCX worker of
# the NIXL agent to the peer's data listener (as UCX does when the remote agent is added:
# test_vllm_shaped_nixl_agent_*); with a path map the ports come from ARK's plan of the pull
# direction (data listener -> us)
CHILD = textwrap.dedent("""
    import json, socket, subprocess, sys
    from vllm_ext.ark.connplan import ListenerPlans
    from vllm_ext.ark.fabric import Fabric
    from vllm_ext.ark.paths import LearnedMap
    from vllm_ext.ark.shim import PortHook, ShimPorts, nixl_ucx_workers
    side, data, planned, base = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1",
                                 int(sys.argv[4]))
    plan = None
    if planned:  # 2 spines; candidate ports alternate in threes, a plan balances them
        paths = LearnedMap({("127.0.0.1", "10.9.0.1", data, p): (p // 3) % 2
                            for p in range(base, base + 64)})
        fabric = Fabric({"127.0.0.1": 0, "10.9.0.1": 1}, 2)
        plans = ListenerPlans("10.9.0.1", fabric, paths, range(base, base + 64), [data])
        plan = lambda peer: plans.ports(peer, nixl_ucx_workers())
    hook = PortHook(ShimPorts(), base, 64, plan=plan)
    socks = []
    def handshake(host, port, n):
        for dport in [port] + [data] * n:
            s = socket.socket()
            s.bind((host, 0))
            s.connect((host, dport))
            socks.append(s)
        return len(socks)
    hook.wrap(handshake)("127.0.0.1", side, nixl_ucx_workers())
    ss = subprocess.run(["ss", "-Htn", "state", "established", "dst", "127.0.0.1"],
                        capture_output=True, text=True).stdout
    conns = [(int(l.split()[2].rsplit(":", 1)[1]), int(l.split()[3].rsplit(":", 1)[1]))
             for l in ss.splitlines() if int(l.split()[3].rsplit(":", 1)[1]) in (side, data)]
    print(json.dumps({"ports": hook.ports_for("127.0.0.1"), "conns": conns,
                      "applied": hook.shim.applied(), "available": hook.shim.available,
                      "warned": hook.warned}))
""")


def _run(preload: bool, planned: bool = False) -> dict:
    servers = [socket.socket(), socket.socket()]
    for server in servers:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
    side, data = (s.getsockname()[1] for s in servers)
    env = {"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
    if preload:
        env["LD_PRELOAD"] = str(build())
    # candidates below the ephemeral range: there any socket on the host may hold one
    base = free_port_block(64)
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, str(side), str(data),
                              str(int(planned)), str(base)],
                             env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        for server in servers:
            server.close()
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["side"], got["data"], got["base"] = side, data, base
    return got


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_registered_ports_carry_every_connection_of_the_pair_on_the_wire():
    got = _run(preload=True)
    data = sorted(local for local, remote in got["conns"] if remote == got["data"])
    (side,) = [local for local, remote in got["conns"] if remote == got["side"]]
    assert got["available"] and not got["warned"]
    assert data == sorted(got["ports"]["0"]) and len(set(data)) == 5  # "0": any dst port
    assert side not in range(got["base"], got["base"] + 64) and got["applied"] == 5


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_planned_ports_from_the_path_map_carry_the_connections():
    got = _run(preload=True, planned=True)
    data = sorted(local for local, remote in got["conns"] if remote == got["data"])
    assert len(set(data)) == 5 and data == sorted(got["ports"][str(got["data"])])
    assert got["applied"] == 5
    spines = [(p // 3) % 2 for p in data]
    assert abs(spines.count(0) - spines.count(1)) == 1  # 5 connections, balanced


def test_without_the_shim_nothing_is_applied_and_it_warns():
    got = _run(preload=False)
    assert not got["available"] and got["warned"] and got["applied"] == 0


def test_peer_ports_are_distinct_in_range_and_stable():
    for peer in ("10.0.0.1", "10.0.0.2", "h3"):
        ports = peer_ports(peer, 40000, 16, 4)
        assert len(set(ports)) == 4 and all(40000 <= p < 40016 for p in ports)
        assert ports == peer_ports(peer, 40000, 16, 4)
    assert peer_ports("a", 40000, 2, 4) == sorted(
        set(peer_ports("a", 40000, 2, 4)), key=peer_ports("a", 40000, 2, 4).index
    )
    with pytest.raises(ValueError):
        peer_ports("a", 40000, 16, 0)


def test_register_is_idempotent_and_refuses_without_lib():
    class Lib:  # a library without the shim's symbols: the unpreloaded case
        pass

    shim = ShimPorts(Lib())
    assert not shim.register("10.0.0.1", [40000]) and shim.applied() == 0


def test_connector_extends_vllms_nixl_pull_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

    from vllm_ext.ark.nixl import ArkNixlConnector

    assert issubclass(ArkNixlConnector, NixlPullConnector)


def test_a_listener_range_smaller_than_the_agents_ucx_workers_is_refused():
    from vllm_ext.ark.config import load_ark_config
    from vllm_ext.ark.nixl import check_listener_range
    from vllm_ext.common.config import ConfigError

    workers = nixl_ucx_workers()
    assert workers == 5  # vLLM's num_threads=4, plus the agent's own worker
    check_listener_range(load_ark_config({"nixl_listener_ports": "47000-47004"}), workers)
    check_listener_range(load_ark_config({}), workers)  # no range: nothing to check
    with pytest.raises(ConfigError, match="needs one per UCX worker"):
        check_listener_range(load_ark_config({"nixl_listener_ports": "47000-47003"}), workers)


# two agents as vLLM makes them (num_threads=4, UCX over TCP on loopback, listeners from a
# UCX_TCP_PORT_RANGE): the listeners the first takes from the range, and the connections
# the second (the reading side) opens to them when it adds the first
AGENTS = textwrap.dedent("""
    import json, os, subprocess, sys
    from nixl._api import nixl_agent, nixl_agent_config
    def ss(*args):  # the lines of this process
        out = subprocess.run(["ss", "-Htnp", *args], capture_output=True, text=True).stdout
        return [l.split() for l in out.splitlines() if f"pid={os.getpid()}," in l]
    port = lambda address: int(address.rsplit(":", 1)[1])
    listening = lambda: {port(f[3]) for f in ss("-l")}
    prefill = nixl_agent("prefill", nixl_agent_config(num_threads=int(sys.argv[1])))
    listeners = listening()
    decode = nixl_agent("decode", nixl_agent_config(num_threads=int(sys.argv[1])))
    ours = listening()
    def dialled():
        pairs = [(port(f[2]), port(f[3])) for f in ss("state", "established")]
        return sorted(local for local, remote in pairs if remote in listeners
                      and local not in ours)
    before = dialled()
    decode.add_remote_agent(prefill.get_agent_metadata())
    print(json.dumps({"listeners": sorted(listeners), "before": before, "after": dialled()}))
""")


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="needs nixl (docs/ark.md)")
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_vllm_shaped_nixl_agent_has_one_listener_and_one_connection_per_ucx_worker():
    first = free_port_block(16)
    env = {"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
           "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo",
           "UCX_TCP_PORT_RANGE": f"{first}-{first + 15}"}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", AGENTS, str(NIXL_THREADS)], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["listeners"]) == nixl_ucx_workers()
    assert all(first <= port <= first + 15 for port in got["listeners"])
    # "before": the agent's own connections to itself, as it makes them at start-up
    assert len(set(got["after"]) - set(got["before"])) == nixl_ucx_workers()
