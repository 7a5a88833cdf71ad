"""ARK's KV transport on loopback: planned source port on the wire, persistent lanes, bad
frames, busy ports, expiry."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from vllm_ext.ark.transport import MAGIC, KvReceiver, KvSender

pytestmark = pytest.mark.unit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ends():
    receiver = KvReceiver("127.0.0.1", 0)
    sender = KvSender("127.0.0.1")
    yield sender, receiver
    sender.close()
    receiver.close()


def _send_and_wait(sender, *args):
    done = threading.Event()
    result = {}

    def on_done(ok, seconds, port):
        result.update(ok=ok, port=port)
        done.set()

    sender.send(*args, done=on_done)
    assert done.wait(10.0)
    return result


def test_frames_arrive_from_the_planned_port_on_one_connection(ends):
    sender, receiver = ends
    port = _free_port()
    payloads = [bytes(range(256)) * 1000, b"", bytearray(b"x" * 3_000_001)]
    for i, payload in enumerate(payloads):
        got = _send_and_wait(sender, f"t{i}", {"i": i}, payload, receiver.address, port)
        assert got == {"ok": True, "port": port}
    for i, payload in enumerate(payloads):
        arrived = receiver.take(f"t{i}", timeout=5.0)
        assert arrived.meta == {"i": i} and bytes(arrived.payload) == bytes(payload)
        assert arrived.peer == ("127.0.0.1", port)
    assert receiver.connections == 1  # a lane is persistent: no handshake per transfer
    assert sender.counters.value("transfers_sent") == 3
    assert sender.counters.value("transfer_bytes") == sum(len(p) for p in payloads)
    assert receiver.take("t0") is None  # taken once


def test_busy_port_falls_back_to_an_ephemeral_port(ends):
    sender, receiver = ends
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        got = _send_and_wait(sender, "t", {}, b"abc", receiver.address, busy)
    assert got["ok"] and got["port"] != busy
    assert sender.counters.value("bind_fallbacks") == 1
    assert receiver.take("t", timeout=5.0).peer[1] == got["port"]


@pytest.mark.parametrize("frame", [
    b"NOPE" + bytes(12),
    struct.pack("!4sIQ", MAGIC, 1 << 30, 0),
    struct.pack("!4sIQ", MAGIC, 5, 0) + b"{bad}",
    struct.pack("!4sIQ", MAGIC, 2, 1 << 40) + b"{}",
])  # fmt: skip
def test_bad_frames_are_rejected_and_the_receiver_keeps_serving(ends, frame):
    sender, receiver = ends
    with socket.create_connection(receiver.address, timeout=5.0) as raw:
        raw.sendall(frame)
        assert raw.recv(1) == b"N"
    assert receiver.counters.value("frames_rejected") == 1
    assert _send_and_wait(sender, "ok", {}, b"fine", receiver.address, _free_port())["ok"]


def test_unreachable_receiver_counts_a_failure(ends):
    sender, _ = ends
    got = _send_and_wait(sender, "t", {}, b"x", ("127.0.0.1", _free_port()), _free_port())
    assert got["ok"] is False
    assert sender.counters.value("transfer_failures") == 1


def test_frames_nobody_takes_expire():
    now = [0.0]
    receiver = KvReceiver("127.0.0.1", 0, ttl_s=5.0, clock=lambda: now[0])
    sender = KvSender("127.0.0.1")
    try:
        assert _send_and_wait(sender, "t", {}, b"x", receiver.address, _free_port())["ok"]
        assert receiver.sweep() == 0
        now[0] = 6.0
        assert receiver.sweep() == 1 and receiver.take("t") is None
    finally:
        sender.close()
        receiver.close()
