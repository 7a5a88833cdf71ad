"""KV-sized TCP flows over the namespace leaf-spine, ARK against its baselines (root; no vLLM).

Prefill senders are the hosts of leaf 0, decode receivers those of leaf 1.
A P/D trace (:mod:`.traces`) fixes when each request's prefill starts and
ends and how many KV bytes it moves; prefill itself is not run, so queue and
prefill times are the trace's and only the transfers are real. Every sender
runs an :class:`~vllm_ext.ark.announce.Announcer` on its own host (the
announcements cross the fabric as UDP) and a
:class:`~vllm_ext.ark.selector.PortSelector` whose path oracle is a
:class:`~vllm_ext.ark.paths.LearnedMap` filled by asking the source leaf's FIB
(``ip route get ... sport ... dport``), i.e. by probing, not from a hash model.

Variants on the same trace (one round = every variant once, same seed):
``random`` (seeded random source port per transfer: plain ECMP), ``ark``
(planned when the prefill is scheduled, announced to the peers), ``ksub``
(each transfer on ``k`` concurrent connections with random ports),
``offline`` (all transfers known up front, spines by
:func:`~vllm_ext.ark.planner.offline_spines`, each mapped to a probed port of
that spine). Per-spine byte counters are read around every run.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import struct
import threading
import time
from collections.abc import Sequence

import numpy as np

from vllm_ext.ark.announce import Announcer
from vllm_ext.ark.fabric import Fabric, Transfer
from vllm_ext.ark.netns import LeafSpine, host_ip, socket_in
from vllm_ext.ark.paths import LearnedMap
from vllm_ext.ark.planner import offline_spines
from vllm_ext.ark.selector import PortSelector
from vllm_ext.ark.traces import PdTrace
from vllm_ext.ark.view import PeerView

VARIANTS = ("random", "ark", "ksub", "offline")
DATA_PORT = 7000
ANNOUNCE_PORT = 9100
CANDIDATES = tuple(range(30000, 30016))
RANDOM_PORTS = (20000, 30000)
_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 20


class Receiver:
    """A decode host's KV listener: reads a length-prefixed payload, acks one byte, closes."""

    def __init__(self, fabric: LeafSpine, leaf: int, index: int):
        self.sock = socket_in(fabric.host(leaf, index))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host_ip(leaf, index), DATA_PORT))
        self.sock.listen(64)
        self.received = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            header = _recv_exact(conn, _HEADER.size)
            if header is None:
                return
            (left,) = _HEADER.unpack(header)
            buf = bytearray(_CHUNK)
            while left > 0:
                got = conn.recv_into(buf, min(left, _CHUNK))
                if not got:
                    return
                left -= got
                self.received += got
            conn.sendall(b"k")  # the receiver closes first: TIME_WAIT stays on this side

    def close(self) -> None:
        self.sock.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


_PAYLOAD = bytes(_CHUNK)


def send_flow(fabric: LeafSpine, src: tuple[int, int], dst_ip: str, sport: int,
              nbytes: int) -> None:  # fmt: skip
    """One TCP flow from host ``src`` bound to ``sport``; returns when the receiver acked."""
    sock = socket_in(fabric.host(*src))
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host_ip(*src), sport))
        sock.connect((dst_ip, DATA_PORT))
        sock.sendall(_HEADER.pack(nbytes))
        left = nbytes
        view = memoryview(_PAYLOAD)
        while left > 0:
            n = min(left, _CHUNK)
            sock.sendall(view[:n])
            left -= n
        if sock.recv(1) != b"k":
            raise ConnectionError(f"no ack from {dst_ip} for {nbytes} bytes")


@dataclasses.dataclass
class Flow:
    """One request's transfer in a run: where, how big, and what happened."""

    index: int
    src: tuple[int, int]
    dst: tuple[int, int]
    nbytes: int
    plan_at: float
    start_at: float
    ports: list[int] = dataclasses.field(default_factory=list)
    fct: float = float("nan")
    error: str | None = None


class Testbed:
    """Receivers, announcers and the learned path map on a built :class:`LeafSpine`."""

    def __init__(self, fabric: LeafSpine, rate_bytes: float, window_scale: float = 2.0,
                 k_subflows: int = 4):  # fmt: skip
        self.fabric, self.rate_bytes = fabric, rate_bytes
        self.window_scale, self.k = window_scale, k_subflows
        self.senders = [(0, i) for i in range(fabric.hosts_per_leaf)]
        self.receivers_at = [(1, i) for i in range(fabric.hosts_per_leaf)]
        self.model = Fabric(fabric.leaf_of_ip(), fabric.n_spines)
        self.paths = LearnedMap()
        for s in self.senders:
            for d in self.receivers_at:
                self.paths.learn(fabric.route_spine, host_ip(*s), host_ip(*d), DATA_PORT,
                                 CANDIDATES)  # fmt: skip
        self.receivers = [Receiver(fabric, *d) for d in self.receivers_at]
        self.announcers: list[Announcer] = []

    def _start_announcers(self, seed: int) -> list[PortSelector]:
        self._stop_announcers()
        addresses = {f"p{i}": (host_ip(*s), ANNOUNCE_PORT) for i, s in enumerate(self.senders)}
        selectors = []
        for i, s in enumerate(self.senders):
            ns = self.fabric.host(*s)
            announcer = _announcer_in(ns, f"p{i}", host_ip(*s), addresses)
            self.announcers.append(announcer.start())
            selectors.append(PortSelector(announcer, self.model, self.paths, seed=seed + i))
        for announcer in self.announcers:
            announcer.heartbeat()
        return selectors

    def _stop_announcers(self) -> None:
        for announcer in self.announcers:
            announcer.close()
        self.announcers = []

    def close(self) -> None:
        self._stop_announcers()
        for receiver in self.receivers:
            receiver.close()

    def flows_of(self, trace: PdTrace, lead_s: float = 0.5) -> list[Flow]:
        t0 = time.monotonic() + lead_s
        return [
            Flow(i, self.senders[trace.prefill_host[i]], self.receivers_at[trace.decode_host[i]],
                 int(trace.kv_bytes[i]), t0 + float(trace.prefill_start[i]),
                 t0 + float(trace.prefill_end[i]))
            for i in range(len(trace))
        ]  # fmt: skip

    def _transfer(self, flow: Flow) -> Transfer:
        window = self.window_scale * flow.nbytes / self.rate_bytes
        return Transfer(f"r{flow.index}", host_ip(*flow.src), host_ip(*flow.dst), flow.nbytes,
                        flow.start_at, flow.start_at + window, 0, DATA_PORT)  # fmt: skip

    def run(self, trace: PdTrace, variant: str, seed: int) -> dict:
        """Run every transfer of ``trace`` under ``variant``; metrics and spine counters."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")
        rng = random.Random(seed)
        selectors = self._start_announcers(seed) if variant == "ark" else []
        flows = self.flows_of(trace)
        offline = offline_spines([self._transfer(f) for f in flows], self.model)
        busy: dict[tuple[int, int], set[int]] = {s: set() for s in self.senders}
        lock = threading.Lock()
        before = self.fabric.spine_tx_bytes()
        threads: list[threading.Thread] = []
        samples: list[tuple[float, list[int]]] = []
        done = threading.Event()
        sampler = threading.Thread(target=self._sample_spines, args=(samples, done), daemon=True)
        sampler.start()

        def free_ports(src, pool: Sequence[int]) -> list[int]:
            return [p for p in pool if p not in busy[src]]

        def plan(flow: Flow) -> None:
            with lock:
                if variant == "ark":
                    selector = selectors[self.senders.index(flow.src)]
                    choice = selector.select(self._transfer(flow), free_ports(flow.src, CANDIDATES))
                    flow.ports = [choice.port]
                elif variant == "offline":
                    want = offline[f"r{flow.index}"]
                    known = self.paths.spines_of(host_ip(*flow.src), host_ip(*flow.dst), DATA_PORT)
                    ports = free_ports(flow.src, [p for p in CANDIDATES if known.get(p) == want])
                    flow.ports = [(ports or free_ports(flow.src, CANDIDATES))[0]]
                else:
                    pool = free_ports(flow.src, range(*RANDOM_PORTS))
                    flow.ports = rng.sample(pool, self.k if variant == "ksub" else 1)
                busy[flow.src].update(flow.ports)

        def transfer(flow: Flow) -> None:
            parts = [flow.nbytes // len(flow.ports)] * len(flow.ports)
            parts[0] += flow.nbytes - sum(parts)
            dst_ip = host_ip(*flow.dst)
            try:
                subs = [threading.Thread(target=send_flow, args=(self.fabric, flow.src, dst_ip,
                                                                 port, n))
                        for port, n in zip(flow.ports, parts, strict=True)]  # fmt: skip
                for sub in subs:
                    sub.start()
                for sub in subs:
                    sub.join()
                flow.fct = time.monotonic() - flow.start_at
            except OSError as exc:
                flow.error = repr(exc)
            finally:
                with lock:
                    busy[flow.src].difference_update(flow.ports)

        events = sorted([(f.plan_at, 0, f) for f in flows] + [(f.start_at, 1, f) for f in flows],
                        key=lambda e: (e[0], e[1], e[2].index))  # fmt: skip
        for at, kind, flow in events:
            time.sleep(max(0.0, at - time.monotonic()))
            if kind == 0:
                plan(flow)
            else:
                thread = threading.Thread(target=transfer, args=(flow,), daemon=True)
                thread.start()
                threads.append(thread)
        for thread in threads:
            thread.join()
        done.set()
        sampler.join()
        after = self.fabric.spine_tx_bytes()
        counters = [a.counters for a in self.announcers]
        self._stop_announcers()
        return {**summarize(flows, trace, before, after, counters), "spine_mb_over_time": samples}

    def _sample_spines(self, samples: list, done: threading.Event, every_s: float = 0.25) -> None:
        # cumulative MB per spine towards the decode leaf, for the bytes-over-time plot
        start, base = time.monotonic(), self.fabric.spine_tx_bytes()
        while not done.wait(every_s):
            now = self.fabric.spine_tx_bytes()
            mb = [round((n[1] - b[1]) / 1e6, 3) for n, b in zip(now, base, strict=True)]
            samples.append((round(time.monotonic() - start, 2), mb))


def _announcer_in(ns: str, peer_id: str, ip_addr: str, addresses: dict) -> Announcer:
    from vllm_ext.ark.netns import in_netns

    view = PeerView(entry_ttl_s=1.0, peer_timeout_s=5.0)
    return in_netns(ns, lambda: Announcer(peer_id, ip_addr, ANNOUNCE_PORT, addresses, view))


def summarize(flows: list[Flow], trace: PdTrace, before, after, counters) -> dict:
    fct = np.array([f.fct for f in flows])
    ok = np.isfinite(fct)
    queue_prefill = trace.prefill_end - trace.arrival
    ttft = fct + queue_prefill
    to_receivers = [sum(a[leaf] - b[leaf] for leaf in a if leaf == 1)
                    for a, b in zip(after, before, strict=True)]  # fmt: skip
    totals = {}
    for c in counters:
        for name in ("planned", "kept_port", "fallback", "announcements_received"):
            totals[name] = totals.get(name, 0) + c.value(name)
    return {
        "mean_fct_s": float(fct[ok].mean()) if ok.any() else float("nan"),
        "p50_fct_s": float(np.median(fct[ok])) if ok.any() else float("nan"),
        "p99_fct_s": float(np.percentile(fct[ok], 99)) if ok.any() else float("nan"),
        "mean_ttft_s": float(ttft[ok].mean()) if ok.any() else float("nan"),
        "flows": len(flows),
        "failed": int((~ok).sum()),
        "errors": sorted({f.error for f in flows if f.error})[:3],
        "spine_mb_to_decode": [round(b / 1e6, 3) for b in to_receivers],
        "fcts_s": [round(float(x), 4) for x in fct],
        "kv_mb": round(sum(f.nbytes for f in flows) / 1e6, 3),
        **{f"ark_{k}": v for k, v in totals.items()},
    }


def run_testbed(trace: PdTrace, variants: Sequence[str], seed: int, *, n_spines: int = 4,
                hosts_per_leaf: int = 4, rate_mbit: float = 40.0) -> dict[str, dict]:  # fmt: skip
    """Build a fabric, run each variant once on ``trace``, tear everything down."""
    with LeafSpine(2, hosts_per_leaf, n_spines, rate_mbit) as fabric:
        bed = Testbed(fabric, rate_mbit * 1e6 / 8)
        try:
            return {v: bed.run(trace, v, seed) for v in variants}
        finally:
            bed.close()
