"""ARK's LD_PRELOAD shim, built from csrc/ and run in child processes on loopback:
planned ports applied (env map and runtime set), rotation, deferred bind, busy port ->
ephemeral, counters, bad input."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from vllm_ext.ark.shim import build

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler"),
]

CHILD = textwrap.dedent("""
    import ctypes, json, socket, sys
    lib = ctypes.CDLL(None)
    lib.ark_shim_applied.restype = lib.ark_shim_fallbacks.restype = ctypes.c_ulong
    args = json.loads(sys.argv[1])
    for ip, dport, sport in args.get("set", []):
        assert lib.ark_shim_set(ip.encode(), dport, sport) == 0
    assert lib.ark_shim_set(b"not-an-ip", 1, 1) == -1 and lib.ark_shim_set(b"1.2.3.4", 1, 0) == -1
    out = []
    for bind_first in args["binds"]:
        s = socket.socket()
        if bind_first:
            s.bind(("127.0.0.1", 0))  # the usual UCX pattern: bind(ip, 0), then connect
        s.connect(("127.0.0.1", args["port"]))
        out.append(s.getsockname())
        s.close()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.connect(("127.0.0.1", args["port"]))  # not TCP: untouched
    print(json.dumps({"local": out, "applied": lib.ark_shim_applied(),
                      "fallbacks": lib.ark_shim_fallbacks()}))
""")


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    return build(cache=tmp_path_factory.mktemp("shim"))


@pytest.fixture
def listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield s.getsockname()[1]
    s.close()


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run(shim, env_map, args):
    env = {**os.environ, "LD_PRELOAD": str(shim)}
    if env_map is not None:
        env["ARK_SPORT_MAP"] = env_map
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_env_map_applies_and_rotates(shim, listener):
    # each connection to one peer takes the next port (a port reused within TIME_WAIT
    # would fail the connect, so a list holds one port per concurrent connection)
    a, b, c = _free_ports(3)
    got = _run(shim, f"127.0.0.1:{listener}={a},{b},{c};bad-item;10.9.9.9:*=5",
               {"port": listener, "binds": [False, True, False]})  # fmt: skip
    assert [tuple(x) for x in got["local"]] == [("127.0.0.1", p) for p in (a, b, c)]
    assert (got["applied"], got["fallbacks"]) == (3, 0)


def test_runtime_set_and_wildcard_port(shim, listener):
    (a,) = _free_ports(1)
    got = _run(shim, None, {"port": listener, "binds": [True], "set": [["127.0.0.1", 0, a]]})
    assert got["local"][0][1] == a and got["applied"] == 1


def test_busy_port_keeps_an_ephemeral_one(shim, listener):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        got = _run(shim, f"127.0.0.1:{listener}={busy}", {"port": listener, "binds": [True]})
    host, port = got["local"][0]
    assert host == "127.0.0.1" and port not in (0, busy)  # the deferred bind(ip, 0) honoured
    assert (got["applied"], got["fallbacks"]) == (0, 1)


def test_other_destinations_are_untouched(shim, listener):
    (a,) = _free_ports(1)
    got = _run(shim, f"127.0.0.2:{listener}={a}", {"port": listener, "binds": [False, True]})
    assert all(port != a for _, port in got["local"])
    assert (got["applied"], got["fallbacks"]) == (0, 0)


def test_build_reuses_the_cached_library(shim):
    assert build(cache=shim.parent) == shim


OPEN_CHILD = textwrap.dedent("""
    import ctypes, json, socket, sys
    lib = ctypes.CDLL(None)
    lib.ark_shim_applied.restype = lib.ark_shim_fallbacks.restype = ctypes.c_ulong
    port, exempt = int(sys.argv[1]), int(sys.argv[2])
    assert lib.ark_shim_exempt(b"127.0.0.1", exempt) == 0
    assert lib.ark_shim_exempt(b"127.0.0.1", 0) == -1 and lib.ark_shim_exempt(b"x", 1) == -1
    socks = [socket.socket() for _ in range(3)]
    for s in socks[:2]:  # both open at once, one port listed: the second must not share it
        s.connect(("127.0.0.1", port))
    socks[2].connect(("127.0.0.1", exempt))
    print(json.dumps({"local": [s.getsockname()[1] for s in socks],
                      "applied": lib.ark_shim_applied(), "fallbacks": lib.ark_shim_fallbacks()}))
""")


def test_a_port_carries_one_live_connection_and_exempt_destinations_stay_ephemeral(shim):
    servers = [socket.socket(), socket.socket()]
    for server in servers:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
    port, exempt = (s.getsockname()[1] for s in servers)
    (a,) = _free_ports(1)
    env = {**os.environ, "LD_PRELOAD": str(shim), "ARK_SPORT_MAP": f"127.0.0.1:*={a}"}
    try:
        proc = subprocess.run([sys.executable, "-c", OPEN_CHILD, str(port), str(exempt)], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        for server in servers:
            server.close()
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    first, second, control = got["local"]
    assert first == a and second != a and control != a
    assert (got["applied"], got["fallbacks"]) == (1, 1)
