"""Announcement channel: UDP datagrams between prefill senders, no coordinator.

Each sender binds one UDP socket and sends its upcoming transfers to every
configured peer (unicast) before their KV is ready, plus a heartbeat every
``heartbeat_s``. Every receiver validates each datagram and merges it into its
own :class:`~vllm_ext.ark.view.PeerView`. Times travel as offsets from the
sender's clock at send time (``start_in``, ``end_in``), so the hosts' clocks
need not agree; the network delay (sub-millisecond in one fabric) is ignored.

Wire format (JSON, one object per datagram, at most ``max_datagram`` bytes)::

    {"v": 1, "peer": "<sender id>", "kind": "announce" | "withdraw" | "heartbeat",
     "transfers": [{"id", "src", "dst", "bytes", "start_in", "end_in",
                    "port", "dst_port", "spine"}], "ids": ["<withdrawn id>", ...]}

With a shared secret (:mod:`vllm_ext.ark.auth`) each datagram is the JSON
followed by a 32-byte HMAC-SHA256 tag over it.

A datagram is dropped and counted (never raised) when it is larger than the
limit or lists too many transfers (``huge``), lacks a valid tag where a secret
is configured (``bad_mac``: checked before the JSON is parsed), is not valid
JSON or fails the schema (``malformed``), or names a peer that is not
configured or comes from another address than that peer's (``unknown_peer``).
UDP may lose datagrams; a lost announcement only makes a view less complete,
never wrong for long (entries expire, announcements are re-sent with every
update).
"""

from __future__ import annotations

import json
import math
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from vllm_ext.ark.auth import ANNOUNCE_LABEL, TAG_BYTES, tag, verify
from vllm_ext.ark.counters import drop_counter, new_counters
from vllm_ext.ark.fabric import Transfer
from vllm_ext.ark.view import PeerView
from vllm_ext.common.counters import Counters

VERSION = 1
KINDS = ("announce", "withdraw", "heartbeat")
MAX_TRANSFERS = 64
_MAX_TEXT = 256


class Dropped(ValueError):
    """A datagram that must be dropped; ``reason`` is its counter label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def encode(peer: str, kind: str, transfers: Iterable[Transfer] = (), ids: Iterable[str] = (),
           now: float = 0.0) -> bytes:  # fmt: skip
    rows = [
        {"id": t.transfer_id, "src": t.src, "dst": t.dst, "bytes": t.nbytes,
         "start_in": t.start - now, "end_in": t.end - now, "port": t.port,
         "dst_port": t.dst_port, "spine": t.spine}
        for t in transfers
    ]  # fmt: skip
    message = {"v": VERSION, "peer": peer, "kind": kind, "transfers": rows, "ids": list(ids)}
    return json.dumps(message, separators=(",", ":")).encode()


def _text(row: Mapping, key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value or len(value) > _MAX_TEXT:
        raise Dropped("malformed", f"{key} must be a non-empty string")
    return value


def _number(row: Mapping, key: str, lo: float, hi: float, integer: bool = False) -> float:
    value = row.get(key)
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or not lo <= value <= hi:
        raise Dropped("malformed", f"{key}={value!r} not in [{lo}, {hi}]")
    return value


def _transfer(row: object, now: float, horizon_s: float) -> Transfer:
    if not isinstance(row, dict):
        raise Dropped("malformed", "a transfer must be an object")
    spine = row.get("spine")
    if spine is not None:
        spine = int(_number(row, "spine", 0, 1 << 16, integer=True))
    start_in = _number(row, "start_in", -horizon_s, horizon_s)
    end_in = _number(row, "end_in", start_in, horizon_s)
    return Transfer(
        transfer_id=_text(row, "id"),
        src=_text(row, "src"),
        dst=_text(row, "dst"),
        nbytes=int(_number(row, "bytes", 0, 1 << 50, integer=True)),
        start=now + start_in,
        end=now + end_in,
        port=int(_number(row, "port", 0, 65535, integer=True)),
        dst_port=int(_number(row, "dst_port", 0, 65535, integer=True)),
        spine=spine,
    )


def decode(data: bytes, now: float, max_datagram: int, horizon_s: float = 3600.0) -> dict:
    """Validated message: ``{"peer", "kind", "transfers": [Transfer], "ids": [str]}``."""
    if len(data) > max_datagram:
        raise Dropped("huge", f"{len(data)} bytes > {max_datagram}")
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Dropped("malformed", f"not JSON ({exc})") from None
    if not isinstance(message, dict) or message.get("v") != VERSION:
        raise Dropped("malformed", "not an ARK v1 message")
    if message.get("kind") not in KINDS:
        raise Dropped("malformed", f"unknown kind {message.get('kind')!r}")
    rows, ids = message.get("transfers", []), message.get("ids", [])
    if not isinstance(rows, list) or not isinstance(ids, list):
        raise Dropped("malformed", "transfers and ids must be lists")
    if len(rows) > MAX_TRANSFERS or len(ids) > MAX_TRANSFERS:
        raise Dropped("huge", f"{len(rows)} transfers / {len(ids)} ids > {MAX_TRANSFERS}")
    peer = _text(message, "peer")
    transfers = [_transfer(row, now, horizon_s) for row in rows]
    if not all(isinstance(i, str) and i for i in ids):
        raise Dropped("malformed", "ids must be non-empty strings")
    return {"peer": peer, "kind": message["kind"], "transfers": transfers, "ids": ids}


class Announcer:
    """One sender's UDP endpoint: announces its transfers, merges its peers' into ``view``.

    ``poll()`` processes whatever has arrived (tests drive it directly);
    ``start()`` runs it on a daemon thread that also sends heartbeats. ``secret``: tag what
    it sends and accept only datagrams tagged with it.
    """

    CHUNK = 16  # transfers per datagram, well under MAX_TRANSFERS and 8 KiB

    def __init__(
        self,
        peer_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        peers: Mapping[str, tuple[str, int]] | None = None,
        view: PeerView | None = None,
        counters: Counters | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_datagram: int = 8192,
        heartbeat_s: float = 0.5,
        secret: bytes | None = None,
    ):
        self.peer_id = peer_id
        self.secret = secret
        self.view = view if view is not None else PeerView()
        self.counters = counters if counters is not None else new_counters()
        self.clock = clock
        self.max_datagram = max_datagram
        self.heartbeat_s = heartbeat_s
        self.peers: dict[str, tuple[str, int]] = {}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind((host, port))
        self.address: tuple[str, int] = self._sock.getsockname()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for name, (peer_host, peer_port) in (peers or {}).items():
            self.add_peer(name, peer_host, peer_port)

    def add_peer(self, peer_id: str, host: str, port: int) -> None:
        if peer_id != self.peer_id:
            self.peers[peer_id] = (socket.gethostbyname(host), int(port))

    def _send(self, payload: bytes, counted: bool = True) -> None:
        if self.secret is not None:
            payload += tag(self.secret, ANNOUNCE_LABEL, payload)
        with self._send_lock:
            for address in self.peers.values():
                try:
                    self._sock.sendto(payload, address)
                except OSError:
                    pass  # a peer that is down just misses it; it drops out of views
            if counted and self.peers:
                self.counters.inc("announcements_sent")

    def announce(self, transfers: Iterable[Transfer]) -> None:
        """Put ``transfers`` (absolute times on this clock) in the own view and tell the peers."""
        transfers, now = list(transfers), self.clock()
        for transfer in transfers:
            self._overflowed(self.view.add(transfer, self.peer_id, now))
        for i in range(0, len(transfers), self.CHUNK):
            self._send(encode(self.peer_id, "announce", transfers[i : i + self.CHUNK], now=now))

    def withdraw(self, transfer_ids: Iterable[str]) -> None:
        ids = list(transfer_ids)
        for transfer_id in ids:
            self.view.remove(transfer_id)
        for i in range(0, len(ids), self.CHUNK):
            self._send(encode(self.peer_id, "withdraw", ids=ids[i : i + self.CHUNK]))

    def heartbeat(self) -> None:
        self.view.heard(self.peer_id, self.clock())
        self._send(encode(self.peer_id, "heartbeat"), counted=False)

    def _overflowed(self, count: int) -> None:
        if count:
            self.counters.inc(drop_counter("overflow"), count)

    def handle(self, data: bytes, address: tuple[str, int]) -> bool:
        """Merge one datagram; False (and counted) when it was dropped."""
        now = self.clock()
        try:
            if self.secret is not None:
                data = self._authenticated(data)
            message = decode(data, now, self.max_datagram)
            known = self.peers.get(message["peer"])
            if known is None or known[0] != address[0]:
                raise Dropped("unknown_peer", f"{message['peer']!r} from {address[0]}")
        except Dropped as exc:
            self.counters.inc(drop_counter(exc.reason))
            return False
        peer = message["peer"]
        self.view.heard(peer, now)
        for transfer in message["transfers"]:
            self._overflowed(self.view.add(transfer, peer, now))
        for transfer_id in message["ids"]:
            self.view.remove(transfer_id)
        if message["kind"] != "heartbeat":
            self.counters.inc("announcements_received")
        return True

    def _authenticated(self, data: bytes) -> bytes:
        """The JSON of a tagged datagram whose tag is right; raises :class:`Dropped`."""
        if len(data) > self.max_datagram + TAG_BYTES:
            raise Dropped("huge", f"{len(data)} bytes > {self.max_datagram + TAG_BYTES}")
        body, received = data[:-TAG_BYTES], data[-TAG_BYTES:]
        if len(data) <= TAG_BYTES or not verify(self.secret, ANNOUNCE_LABEL, received, body):
            raise Dropped("bad_mac", "missing or wrong HMAC tag")
        return body

    def poll(self, timeout: float = 0.0) -> int:
        """Handle every datagram that arrives within ``timeout`` s (returns at the first
        batch); the number handled, dropped ones included."""
        handled = 0
        try:
            ready, _, _ = select.select([self._sock], [], [], timeout)
        except (OSError, ValueError):  # closed meanwhile
            return 0
        while ready:
            try:
                data, address = self._sock.recvfrom(self.max_datagram + TAG_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            self.handle(data, address)
            handled += 1
        return handled

    def current_view(self) -> list[Transfer] | None:
        """Live transfers, or None when peers are configured but none is alive (no view)."""
        now = self.clock()
        live = self.view.live(now)
        if self.peers and not set(self.peers) & set(self.view.live_peers(now)):
            return None
        return live

    def start(self) -> Announcer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"ark-announce-{self.peer_id}",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        return self

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            if self.clock() >= next_beat:
                self.heartbeat()
                next_beat = self.clock() + self.heartbeat_s
            self.poll(min(self.heartbeat_s, 0.1))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        self._sock.close()

    def __enter__(self) -> Announcer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
