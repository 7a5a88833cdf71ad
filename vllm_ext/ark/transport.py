"""ARK's KV data transport: length-prefixed frames over persistent TCP connections (no vLLM).

The sender keeps one connection per ``(destination, source port)`` -- a lane
-- bound to its source port *before* ``connect``, so the planned port is the
one on the wire, and reused by later transfers on that port (no handshake or
TIME_WAIT per transfer). A lane sends one frame at a time and waits for the
receiver's one-byte ack, so completion means the bytes arrived. If the port
is busy the lane connects from an ephemeral port instead (``bind_fallbacks``).

Frame: ``b"ARK1"``, header length (u32), payload length (u64), a JSON header
``{"transfer_id", "meta"}``, the payload. The receiver drops (and counts)
frames with a bad magic, an oversized header or payload, or bad JSON, and
closes that connection; complete frames wait in memory, keyed by transfer id,
until taken or until ``ttl_s`` passes.

Who may send (:mod:`vllm_ext.ark.auth`): a receiver given ``allowed_hosts``
closes connections from any other address before reading a byte
(``frames_unknown_sender``). With a shared ``secret`` the magic is ``b"ARKH"``
and the payload is followed by an HMAC-SHA256 tag over prefix, header and
payload; a frame whose tag is missing or wrong is dropped before its header is
parsed (``frames_unauthenticated``), so a forged frame never reaches the
transfer it names and the request's own frame is still taken.
"""

from __future__ import annotations

import errno
import json
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from vllm_ext.ark.auth import FRAME_LABEL, TAG_BYTES, tag, verify
from vllm_ext.ark.counters import new_counters
from vllm_ext.common.counters import Counters
from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

MAGIC, MAGIC_MAC = b"ARK1", b"ARKH"
_PREFIX = struct.Struct("!4sIQ")
MAX_HEADER = 64 << 10
ACK, NACK = b"A", b"N"
Done = Callable[[bool, float, int], None]  # (ok, seconds, source port used)


@dataclass
class Arrived:
    transfer_id: str
    meta: dict[str, Any]
    payload: bytearray
    at: float
    peer: tuple[str, int]  # the sender's address as seen here: its source port is on the wire


def _parse_header(header: bytearray) -> tuple[str, dict] | None:
    """``(transfer_id, meta)`` of a JSON header, or None when it is not one."""
    try:
        decoded = json.loads(header)
        transfer_id, meta = decoded["transfer_id"], decoded["meta"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(transfer_id, str) or not transfer_id or not isinstance(meta, dict):
        return None
    return transfer_id, meta


def _recv_into(conn: socket.socket, view: memoryview) -> bool:
    while len(view):
        got = conn.recv_into(view)
        if not got:
            return False
        view = view[got:]
    return True


class KvReceiver:
    """Accepts frames on ``host:port`` (port 0: any free port, see ``address``).

    ``allowed_hosts``: the only sender addresses accepted (None: any). ``secret``: frames
    must carry its HMAC tag (None: untagged frames).
    """

    def __init__(self, host: str, port: int, max_payload: int = 16 << 30, ttl_s: float = 60.0,
                 counters: Counters | None = None, clock=time.monotonic,
                 allowed_hosts: Collection[str] | None = None,
                 secret: bytes | None = None):  # fmt: skip
        self.max_payload, self.ttl_s, self.clock = max_payload, ttl_s, clock
        self.counters = counters if counters is not None else new_counters()
        self.allowed_hosts = None if allowed_hosts is None else frozenset(allowed_hosts)
        self.secret = secret
        self._warned: set[tuple[str, str]] = set()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.address: tuple[str, int] = self._sock.getsockname()
        self._arrived: dict[str, Arrived] = {}
        self._cond = threading.Condition()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.connections = 0
        self._thread = threading.Thread(target=self._accept, name="ark-kv-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, address = self._sock.accept()
            except OSError:
                return
            if self.allowed_hosts is not None and address[0] not in self.allowed_hosts:
                # not one of our senders: nothing it sends is read
                self.counters.inc("frames_unknown_sender")
                self._warn_once(address[0], "its address is not in kv_senders")
                conn.close()
                continue
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), name="ark-kv-recv",
                             daemon=True).start()  # fmt: skip

    def _serve(self, conn: socket.socket) -> None:
        try:
            peer = conn.getpeername()
            while self._read_frame(conn, peer):
                pass
        except OSError:
            pass
        finally:
            with self._cond:
                self._conns.discard(conn)
            conn.close()

    def _reject(self, conn: socket.socket, counter: str = "frames_rejected") -> bool:
        self.counters.inc(counter)
        try:
            conn.sendall(NACK)
        except OSError:
            pass
        return False

    def _warn_once(self, host: str, why: str) -> None:
        if (host, why) not in self._warned:
            self._warned.add((host, why))
            logger.warning("ARK: dropping KV frames from %s: %s", host, why)

    def _read_frame(self, conn: socket.socket, peer: tuple[str, int]) -> bool:
        prefix = bytearray(_PREFIX.size)
        if not _recv_into(conn, memoryview(prefix)):
            return False
        magic, header_len, payload_len = _PREFIX.unpack(prefix)
        expected = MAGIC if self.secret is None else MAGIC_MAC
        if magic in (MAGIC, MAGIC_MAC) and magic != expected:
            self._warn_once(peer[0], "untagged frame" if self.secret else "tagged frame, no secret")
            return self._reject(conn, "frames_unauthenticated")
        if magic != expected or header_len > MAX_HEADER or payload_len > self.max_payload:
            return self._reject(conn)
        header = bytearray(header_len)
        if not _recv_into(conn, memoryview(header)):
            return False
        # untagged: refuse a bad header before allocating the payload; tagged: parse nothing
        # before the tag is checked
        parsed = _parse_header(header) if self.secret is None else None
        if self.secret is None and parsed is None:
            return self._reject(conn)
        payload = bytearray(payload_len)
        if not _recv_into(conn, memoryview(payload)):
            return False
        if self.secret is not None:
            received = bytearray(TAG_BYTES)
            if not _recv_into(conn, memoryview(received)):
                return False
            if not verify(self.secret, FRAME_LABEL, bytes(received), prefix, header, payload):
                self._warn_once(peer[0], "wrong HMAC tag (forged, altered, or another secret)")
                return self._reject(conn, "frames_unauthenticated")
            parsed = _parse_header(header)
            if parsed is None:
                return self._reject(conn)
        transfer_id, meta = parsed
        with self._cond:
            self._arrived[transfer_id] = Arrived(transfer_id, meta, payload, self.clock(), peer)
            self._cond.notify_all()
        self.counters.inc("transfers_received")
        conn.sendall(ACK)
        return True

    def take(self, transfer_id: str, timeout: float = 0.0) -> Arrived | None:
        """The frame for ``transfer_id`` (removed from the receiver), waiting up to ``timeout``."""
        deadline = self.clock() + timeout
        with self._cond:
            while transfer_id not in self._arrived:
                left = deadline - self.clock()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._arrived.pop(transfer_id)

    def sweep(self) -> int:
        """Drop frames nobody took within ``ttl_s``; how many."""
        now = self.clock()
        with self._cond:
            old = [t for t, a in self._arrived.items() if now - a.at > self.ttl_s]
            for transfer_id in old:
                del self._arrived[transfer_id]
        if old:
            self.counters.inc("frames_rejected", len(old))
        return len(old)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2.0)


@dataclass
class _Job:
    transfer_id: str
    meta: dict[str, Any]
    payload: Any  # bytes-like
    done: Done | None
    ready: Callable[[], None] | None = None  # e.g. waits for a device->host copy


@dataclass
class _Lane:
    dst: tuple[str, int]
    sport: int
    jobs: queue.Queue = field(default_factory=queue.Queue)
    sock: socket.socket | None = None
    bound_port: int = 0
    thread: threading.Thread | None = None


class KvSender:
    """Sends frames from ``src_host`` on lanes keyed by (destination, source port).

    ``secret``: tag every frame with its HMAC (the receivers must hold the same secret).
    """

    def __init__(self, src_host: str, counters: Counters | None = None,
                 connect_timeout_s: float = 10.0, io_timeout_s: float = 120.0,
                 secret: bytes | None = None):  # fmt: skip
        self.src_host = src_host
        self.secret = secret
        self.counters = counters if counters is not None else new_counters()
        self.connect_timeout_s, self.io_timeout_s = connect_timeout_s, io_timeout_s
        self._lanes: dict[tuple[str, int, int], _Lane] = {}
        self._lock = threading.Lock()
        self._closed = False

    def send(self, transfer_id: str, meta: dict[str, Any], payload, dst: tuple[str, int],
             sport: int, done: Done | None = None, ready=None) -> None:  # fmt: skip
        """Queue one frame on the lane ``(dst, sport)``; ``done`` is called from its thread."""
        key = (dst[0], int(dst[1]), int(sport))
        with self._lock:
            if self._closed:
                raise RuntimeError("KvSender is closed")
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane((dst[0], int(dst[1])), int(sport))
                name = f"ark-kv-send-{sport}"
                lane.thread = threading.Thread(target=self._run, args=(lane,), name=name,
                                               daemon=True)  # fmt: skip
                lane.thread.start()
        lane.jobs.put(_Job(transfer_id, meta, payload, done, ready))

    def _connect(self, lane: _Lane) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.src_host, lane.sport))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                sock.close()
                raise
            self.counters.inc("bind_fallbacks")
            sock.bind((self.src_host, 0))
        sock.settimeout(self.connect_timeout_s)
        try:
            sock.connect(lane.dst)
        except OSError:
            sock.close()
            raise
        sock.settimeout(self.io_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lane.bound_port = sock.getsockname()[1]
        return sock

    def _run(self, lane: _Lane) -> None:
        while True:
            job = lane.jobs.get()
            if job is None:
                break
            start = time.monotonic()
            ok = False
            try:
                if job.ready is not None:
                    job.ready()
                if lane.sock is None:
                    lane.sock = self._connect(lane)
                ok = self._send_frame(lane.sock, job)
            except OSError:
                ok = False
            if not ok and lane.sock is not None:
                lane.sock.close()  # reconnect for the next job
                lane.sock = None
            nbytes = len(memoryview(job.payload).cast("B")) if ok else 0
            self.counters.inc("transfers_sent" if ok else "transfer_failures")
            if ok:
                self.counters.inc("transfer_bytes", nbytes)
            if job.done is not None:
                job.done(ok, time.monotonic() - start, lane.bound_port)
        if lane.sock is not None:
            lane.sock.close()

    def _send_frame(self, sock: socket.socket, job: _Job) -> bool:
        header = json.dumps({"transfer_id": job.transfer_id, "meta": job.meta}).encode()
        payload = memoryview(job.payload).cast("B")
        magic = MAGIC if self.secret is None else MAGIC_MAC
        prefix = _PREFIX.pack(magic, len(header), len(payload))
        sock.sendall(prefix + header)
        sock.sendall(payload)
        if self.secret is not None:
            sock.sendall(tag(self.secret, FRAME_LABEL, prefix, header, payload))
        return sock.recv(1) == ACK

    def lanes(self) -> dict[tuple[str, int, int], int]:
        """``{(dst host, dst port, planned port): port actually bound}`` of open lanes."""
        with self._lock:
            return {key: lane.bound_port for key, lane in self._lanes.items()}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.jobs.put(None)
        for lane in lanes:
            if lane.thread is not None:
                lane.thread.join(timeout=5.0)
