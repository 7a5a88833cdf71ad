"""ArkNixlConnector's port hook with the real shim: the ports registered before a
handshake are the ones the connections opened after it use (checked with ``ss``);
without the shim preloaded nothing is applied and it says so. A NIXL transfer
itself needs the ``nixl`` package (not a dependency of this project): see docs/ark.md."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from vllm_ext.ark.shim import ShimPorts, build, peer_ports

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler"),
]

# what the decode worker does: the hook runs, then the "handshake" asks the peer's side
# channel (a control connection, kept ephemeral) and opens one connection per NIXL worker
# thread to the peer's data listener (as UCX does when the remote agent is added); with a
# path map the ports come from ARK's plan of the pull direction (data listener -> us)
CHILD = textwrap.dedent("""
    import json, socket, subprocess, sys
    from vllm_ext.ark.connplan import ListenerPlans
    from vllm_ext.ark.fabric import Fabric
    from vllm_ext.ark.paths import LearnedMap
    from vllm_ext.ark.shim import PortHook, ShimPorts
    side, data, planned = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    plan = None
    if planned:  # 2 spines; ports 41000.. alternate, so a plan takes 2 of each spine
        paths = LearnedMap({("127.0.0.1", "10.9.0.1", data, p): (p // 3) % 2
                            for p in range(41000, 41064)})
        fabric = Fabric({"127.0.0.1": 0, "10.9.0.1": 1}, 2)
        plans = ListenerPlans("10.9.0.1", fabric, paths, range(41000, 41064), [data])
        plan = lambda peer: plans.ports(peer, 4)
    hook = PortHook(ShimPorts(), 41000, 64, plan=plan)
    socks = []
    def handshake(host, port, n):
        for dport in [port] + [data] * n:
            s = socket.socket()
            s.bind((host, 0))
            s.connect((host, dport))
            socks.append(s)
        return len(socks)
    hook.wrap(handshake)("127.0.0.1", side, 4)
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
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, str(side), str(data), str(int(planned))],
                             env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        for server in servers:
            server.close()
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["side"], got["data"] = side, data
    return got


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_registered_ports_carry_every_connection_of_the_pair_on_the_wire():
    got = _run(preload=True)
    data = sorted(local for local, remote in got["conns"] if remote == got["data"])
    (side,) = [local for local, remote in got["conns"] if remote == got["side"]]
    assert got["available"] and not got["warned"]
    assert data == sorted(got["ports"]["0"]) and len(set(data)) == 4  # "0": any dst port
    assert side not in range(41000, 41064) and got["applied"] == 4  # control: ephemeral


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_planned_ports_from_the_path_map_carry_the_connections():
    got = _run(preload=True, planned=True)
    data = sorted(local for local, remote in got["conns"] if remote == got["data"])
    assert data == sorted(got["ports"][str(got["data"])]) and got["applied"] == 4
    assert sorted((p // 3) % 2 for p in data) == [0, 0, 1, 1]  # 2 connections per spine


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
