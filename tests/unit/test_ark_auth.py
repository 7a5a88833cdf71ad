"""Who may send ARK KV frames and announcements: allowed addresses and HMAC-SHA256 tags.

On loopback (127.0.0.0/8 is all local on Linux, so 127.0.0.2 is another sender address).
The raw frames below are built by hand exactly as ``KvSender`` builds them; the test that a
hand-built frame with the right key is accepted shows the rejections are the tag's doing.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading

import pytest

from vllm_ext.ark import auth
from vllm_ext.ark.announce import Announcer, encode
from vllm_ext.ark.config import ArkConfig
from vllm_ext.ark.fabric import Transfer
from vllm_ext.ark.transport import MAGIC, MAGIC_MAC, KvReceiver, KvSender
from vllm_ext.common.config import ConfigError

pytestmark = pytest.mark.unit

SECRET = b"0123456789abcdef0123456789abcdef"
OTHER = b"fedcba9876543210fedcba9876543210"


def _frame(transfer_id: str, payload: bytes, key: bytes | None, tamper: int | None = None):
    """A frame as KvSender writes it; ``tamper``: flip that byte after tagging."""
    header = json.dumps({"transfer_id": transfer_id, "meta": {"n": 1}}).encode()
    prefix = struct.pack("!4sIQ", MAGIC if key is None else MAGIC_MAC, len(header), len(payload))
    body = prefix + header + payload
    if key is not None:
        body += auth.tag(key, auth.FRAME_LABEL, prefix, header, payload)
    if tamper is not None:
        body = body[:tamper] + bytes([body[tamper] ^ 0x01]) + body[tamper + 1 :]
    return body


def _deliver(address, frame: bytes, source: str = "127.0.0.1") -> bytes:
    with socket.socket() as raw:
        raw.bind((source, 0))
        raw.settimeout(5.0)
        raw.connect(address)
        raw.sendall(frame)
        try:
            return raw.recv(1)
        except ConnectionResetError:
            return b""


def _send_and_wait(sender, transfer_id, payload, dst) -> bool:
    done, result = threading.Event(), {}

    def on_done(ok, seconds, port):
        result["ok"] = ok
        done.set()

    sender.send(transfer_id, {"n": 1}, payload, dst, 0, done=on_done)
    assert done.wait(10.0)
    return result["ok"]


@pytest.fixture
def receiver():
    r = KvReceiver("127.0.0.1", 0, secret=SECRET)
    yield r
    r.close()


def test_tag_checks_every_byte_the_key_and_the_label():
    parts = (b"prefix", b"header", b"payload")
    good = auth.tag(SECRET, auth.FRAME_LABEL, *parts)
    assert auth.verify(SECRET, auth.FRAME_LABEL, good, *parts)
    assert not auth.verify(OTHER, auth.FRAME_LABEL, good, *parts)
    assert not auth.verify(SECRET, auth.ANNOUNCE_LABEL, good, *parts)
    assert not auth.verify(SECRET, auth.FRAME_LABEL, good[:-1], *parts)
    for i, part in enumerate(parts):
        for j in range(len(part)):
            changed = list(parts)
            changed[i] = part[:j] + bytes([part[j] ^ 0x80]) + part[j + 1 :]
            assert not auth.verify(SECRET, auth.FRAME_LABEL, good, *changed), (i, j)


def test_a_hand_built_frame_with_the_right_key_is_accepted(receiver):
    assert _deliver(receiver.address, _frame("t", b"kv bytes", SECRET)) == b"A"
    assert bytes(receiver.take("t", timeout=5.0).payload) == b"kv bytes"
    assert receiver.counters.value("frames_unauthenticated") == 0


@pytest.mark.parametrize(
    "frame",
    [
        _frame("t", b"kv bytes", OTHER),  # another secret
        _frame("t", b"kv bytes", None),  # untagged
        # the length field, the transfer id ("t" -> "u"), the payload, the tag
        *(_frame("t", b"kv bytes", SECRET, tamper=i) for i in (4, 33, -36, -1)),
    ],
    ids=["other-key", "untagged", "length", "transfer-id", "payload", "tag"],
)
def test_a_forged_or_tampered_frame_is_dropped_and_counted(receiver, frame):
    assert _deliver(receiver.address, frame) in (b"N", b"")
    assert receiver.take("t", timeout=0.2) is None and receiver.take("u") is None
    dropped = receiver.counters.value("frames_unauthenticated") + receiver.counters.value(
        "frames_rejected"
    )
    assert dropped == 1 and receiver.counters.value("transfers_received") == 0


def test_a_flipped_payload_byte_is_unauthenticated_not_malformed(receiver):
    assert _deliver(receiver.address, _frame("t", b"kv bytes", SECRET, tamper=-33)) == b"N"
    assert receiver.counters.value("frames_unauthenticated") == 1


def test_a_forged_frame_for_a_live_transfer_leaves_the_real_one(receiver):
    sender = KvSender("127.0.0.1", secret=SECRET)
    try:
        assert _send_and_wait(sender, "live", b"real kv", receiver.address)
        assert _deliver(receiver.address, _frame("live", b"forged kv", OTHER)) == b"N"
        assert bytes(receiver.take("live", timeout=5.0).payload) == b"real kv"
        assert receiver.counters.value("frames_unauthenticated") == 1
    finally:
        sender.close()


def test_a_sender_without_the_secret_fails_and_one_with_it_succeeds(receiver):
    plain, keyed = KvSender("127.0.0.1"), KvSender("127.0.0.1", secret=SECRET)
    try:
        assert not _send_and_wait(plain, "p", b"x", receiver.address)
        assert _send_and_wait(keyed, "k", b"x", receiver.address)
        assert receiver.counters.value("frames_unauthenticated") == 1
        assert receiver.take("p") is None and receiver.take("k", timeout=5.0) is not None
    finally:
        plain.close()
        keyed.close()


def test_only_allowed_sender_addresses_are_read():
    receiver = KvReceiver("127.0.0.1", 0, allowed_hosts=["127.0.0.2"])
    stranger, peer = KvSender("127.0.0.1"), KvSender("127.0.0.2")
    try:
        assert not _send_and_wait(stranger, "s", b"x", receiver.address)
        assert receiver.take("s", timeout=0.2) is None
        assert receiver.counters.value("frames_unknown_sender") == 1
        assert _send_and_wait(peer, "p", b"x", receiver.address)
        assert receiver.take("p", timeout=5.0).peer[0] == "127.0.0.2"
    finally:
        for part in (stranger, peer, receiver):
            part.close()


def _transfer() -> Transfer:
    return Transfer("t1", "10.0.0.1", "10.1.0.1", 10**9, 101.0, 103.0, 40001, 7000)


@pytest.fixture
def announcers():
    a = Announcer("a", secret=SECRET, clock=lambda: 100.0)
    b = Announcer("b", secret=SECRET, clock=lambda: 100.0)
    a.add_peer("b", *b.address)
    b.add_peer("a", *a.address)
    yield a, b
    a.close()
    b.close()


def test_tagged_announcements_are_merged(announcers):
    a, b = announcers
    a.announce([_transfer()])
    assert b.poll(timeout=2.0) == 1
    assert [t.transfer_id for t in b.view.live(100.0)] == ["t1"]


def test_spoofed_announcements_from_a_peers_own_address_are_dropped(announcers):
    """Same address and peer id as ``a`` (what a spoofed source looks like), but no valid tag."""
    a, b = announcers
    body = encode("a", "announce", [_transfer()], now=100.0)
    good = body + auth.tag(SECRET, auth.ANNOUNCE_LABEL, body)
    forged = [
        body,  # untagged
        body + auth.tag(OTHER, auth.ANNOUNCE_LABEL, body),  # another secret
        body + auth.tag(SECRET, auth.FRAME_LABEL, body),  # a frame's tag
        good[:10] + b"9" + good[11:],  # tampered after tagging
        b"",
    ]
    for datagram in forged:
        a._sock.sendto(datagram, b.address)  # from a's socket: the right source address
    handled = 0
    while handled < len(forged):
        got = b.poll(timeout=2.0)
        assert got, f"only {handled} of {len(forged)} datagrams arrived"
        handled += got
    assert b.counters.value("announcements_dropped_bad_mac") == len(forged)
    assert b.view.live(100.0) == [] and b.counters.value("announcements_received") == 0
    a._sock.sendto(good, b.address)
    b.poll(timeout=2.0)
    assert b.counters.value("announcements_received") == 1


def test_load_secret(tmp_path, caplog):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    os.chmod(path, 0o600)
    assert auth.load_secret(path) == SECRET
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_ext.ark.auth"):
        assert auth.load_secret(path) == SECRET
    assert "readable by other users" in caplog.text
    path.write_bytes(b"short\n")
    with pytest.raises(ConfigError, match="at least 16"):
        auth.load_secret(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        auth.load_secret(tmp_path / "missing")


def test_config_checks_senders_and_secret_file():
    assert ArkConfig(kv_senders=("10.0.0.1",), secret_file="/etc/ark.key").kv_senders
    with pytest.raises(ConfigError, match="kv_senders: 'prefill-1' is not an IPv4"):
        ArkConfig(kv_senders=("prefill-1",))
    with pytest.raises(ConfigError, match="secret_file must be a file path"):
        ArkConfig(secret_file="")
