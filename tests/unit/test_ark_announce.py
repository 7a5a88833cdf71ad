"""ARK announcements over real UDP sockets on loopback: merge, expiry, dead peers, bad input."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest

from vllm_ext.ark.announce import MAX_TRANSFERS, Announcer, Dropped, decode, encode
from vllm_ext.ark.fabric import Transfer
from vllm_ext.ark.view import PeerView

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pair():
    """Two announcers that know each other, on one fake clock each."""
    clock_a, clock_b = Clock(100.0), Clock(5000.0)  # unrelated clocks: offsets travel
    a = Announcer("a", clock=clock_a, view=PeerView(entry_ttl_s=1.0, peer_timeout_s=3.0))
    b = Announcer("b", clock=clock_b, view=PeerView(entry_ttl_s=1.0, peer_timeout_s=3.0))
    a.add_peer("b", *b.address)
    b.add_peer("a", *a.address)
    yield a, b, clock_a, clock_b
    a.close()
    b.close()


def _t(tid="t1", start=101.0, end=103.0, **kw):
    return Transfer(tid, kw.pop("src", "10.0.0.1"), "10.1.0.1", 10**9, start, end, 40001, 7000,
                    **kw)  # fmt: skip


def test_announce_reaches_the_peer_in_its_own_clock(pair):
    a, b, _, _ = pair
    a.announce([_t(spine=2)])
    assert b.poll(timeout=2.0) == 1
    (got,) = b.view.live(5000.0)
    assert (got.transfer_id, got.port, got.spine, got.nbytes) == ("t1", 40001, 2, 10**9)
    assert got.start == pytest.approx(5001.0) and got.end == pytest.approx(5003.0)
    assert [t.transfer_id for t in a.view.live(100.0)] == ["t1"]  # own transfers count too
    assert b.counters.value("announcements_received") == 1


def test_withdraw_and_expiry(pair):
    a, b, _, clock_b = pair
    a.announce([_t("x"), _t("y", start=100.0, end=100.5)])
    b.poll(timeout=2.0)
    assert {t.transfer_id for t in b.view.live(clock_b.now)} == {"x", "y"}
    clock_b.now += 1.6  # y ended at +0.5, ttl 1.0
    assert {t.transfer_id for t in b.view.live(clock_b.now)} == {"x"}
    a.withdraw(["x"])
    b.poll(timeout=2.0)
    assert b.view.live(clock_b.now) == []


def test_dead_peer_drops_out_and_the_sender_falls_back(pair):
    a, b, _, clock_b = pair
    assert b.current_view() is None  # never heard from a: no view
    a.announce([_t(end=1000.0)])
    b.poll(timeout=2.0)
    assert [t.transfer_id for t in b.current_view()] == ["t1"]
    clock_b.now += 3.5  # a silent for longer than peer_timeout_s
    assert b.current_view() is None
    assert b.view.live(clock_b.now) == []
    a.heartbeat()
    b.poll(timeout=2.0)
    assert b.current_view() == []  # alive again, its old entries stay gone


def test_a_lone_sender_plans_from_its_own_transfers():
    with Announcer("solo", clock=Clock(100.0)) as solo:
        solo.announce([_t()])
        assert [t.transfer_id for t in solo.current_view()] == ["t1"]


def _raw_send(payload: bytes, address, source=("127.0.0.1", 0)):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(source)
        s.sendto(payload, address)


def test_bad_datagrams_are_dropped_and_counted(pair):
    a, b, _, _ = pair
    good = json.loads(encode("a", "announce", [_t()], now=100.0))
    cases = {
        "malformed": [b"\xff\xfe not json", b"[1,2]", json.dumps({**good, "v": 9}).encode(),
                      json.dumps({**good, "kind": "rm -rf"}).encode(),
                      json.dumps({**good, "transfers": [{**good["transfers"][0], "port": 70000}]}
                                 ).encode(),
                      json.dumps({**good, "transfers": [{**good["transfers"][0], "bytes": -1}]}
                                 ).encode(),
                      json.dumps({**good, "transfers": [{**good["transfers"][0], "end_in": "x"}]}
                                 ).encode(),
                      json.dumps({**good, "transfers": ["nope"]}).encode()],
        "huge": [b" " * (b.max_datagram + 1),
                 json.dumps({**good, "ids": ["z"] * (MAX_TRANSFERS + 1)}).encode()],
        "unknown_peer": [json.dumps({**good, "peer": "mallory"}).encode()],
    }  # fmt: skip
    for payloads in cases.values():
        for payload in payloads:
            _raw_send(payload, b.address)
    # a known peer's id from another address is not that peer
    _raw_send(json.dumps(good).encode(), b.address, source=("127.0.0.2", 0))
    total = sum(len(p) for p in cases.values()) + 1
    handled = 0
    while handled < total:
        got = b.poll(timeout=2.0)
        assert got, f"only {handled} of {total} datagrams arrived"
        handled += got
    assert b.counters.value("announcements_dropped_malformed") == len(cases["malformed"])
    assert b.counters.value("announcements_dropped_huge") == len(cases["huge"])
    assert b.counters.value("announcements_dropped_unknown_peer") == 2
    assert b.view.live(5000.0) == []
    a.announce([_t()])  # still serving
    b.poll(timeout=2.0)
    assert len(b.view.live(5000.0)) == 1


def test_view_is_bounded_and_counts_overflow():
    view = PeerView(max_entries=3)
    with Announcer("a", view=view, clock=Clock(0.0)) as a:
        a.announce([_t(f"t{i}", start=0.0, end=float(i)) for i in range(5)])
        assert {t.transfer_id for t in view.live(0.0)} == {"t2", "t3", "t4"}
        assert a.counters.value("announcements_dropped_overflow") == 2


def test_decode_roundtrip_and_errors():
    t = _t(spine=None)
    message = decode(encode("p", "announce", [t], now=100.0), now=7.0, max_datagram=8192)
    (back,) = message["transfers"]
    assert back.start == pytest.approx(8.0) and back.spine is None
    with pytest.raises(Dropped, match="huge"):
        decode(b"{}" * 10, now=0.0, max_datagram=5)
    with pytest.raises(Dropped, match="malformed"):
        decode(b'{"v": 1, "kind": "announce", "peer": ""}', now=0.0, max_datagram=100)


def test_selector_plans_around_a_peer_and_falls_back_without_a_view(pair):
    from vllm_ext.ark.fabric import Fabric
    from vllm_ext.ark.paths import LearnedMap
    from vllm_ext.ark.selector import FALLBACK, PortSelector

    a, b, clock_a, clock_b = pair
    fabric = Fabric({"10.0.0.1": 0, "10.0.0.2": 0, "10.1.0.1": 1}, n_spines=2)
    paths = LearnedMap({("10.0.0.2", "10.1.0.1", p, 7000): p % 2 for p in (5000, 5001)})
    selector = PortSelector(b, fabric, paths, seed=0)
    mine = Transfer("m", "10.0.0.2", "10.1.0.1", 10**9, 5001.0, 5003.0, 1, 7000)
    choice = selector.select(mine, [5000, 5001])
    assert choice.reason == FALLBACK and choice.port in (5000, 5001)
    assert b.counters.value("fallback") == 1
    a.announce([_t(spine=1)])  # a's flow on spine 1, same window
    b.poll(timeout=2.0)
    choice = selector.select(dataclasses.replace(mine, transfer_id="m2"), [5000, 5001])
    assert (choice.reason, choice.port) == ("planned", 5000)
    assert b.counters.value("planned") == 1
    a.poll(timeout=2.0)  # b announced its choices; a sees the planned one on spine 0
    assert {t.transfer_id: t.spine for t in a.view.live(clock_a.now)}["m2"] == 0
