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

# what the decode worker does: the hook runs, then the "handshake" opens one connection per
# NIXL worker thread to the peer (as UCX does when the remote agent is added)
CHILD = textwrap.dedent("""
    import json, socket, subprocess, sys
    from vllm_ext.ark.shim import PortHook
    from vllm_ext.ark.shim import ShimPorts
    port = int(sys.argv[1])
    hook = PortHook(ShimPorts(), 41000, 64)
    socks = []
    def handshake(host, n):
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            s.connect((host, port))
            socks.append(s)
        return len(socks)
    wrapped = hook.wrap(handshake)
    wrapped("127.0.0.1", 4)
    ss = subprocess.run(["ss", "-Htn", "state", "established", f"dst 127.0.0.1:{port}"],
                        capture_output=True, text=True).stdout
    print(json.dumps({"ports": hook.ports_for("127.0.0.1"), "ss": ss,
                      "applied": hook.shim.applied(), "available": hook.shim.available,
                      "warned": hook.warned}))
""")


def _run(preload: bool) -> dict:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    env = {"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
    if preload:
        env["LD_PRELOAD"] = str(build())
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, str(server.getsockname()[1])],
                             env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        server.close()
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_registered_ports_carry_every_connection_of_the_pair_on_the_wire():
    got = _run(preload=True)
    local = sorted(int(line.split()[2].rsplit(":", 1)[1]) for line in got["ss"].splitlines())
    assert got["available"] and not got["warned"]
    assert local == sorted(got["ports"]) and len(set(local)) == 4
    assert got["applied"] == 4


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
