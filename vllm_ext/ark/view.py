"""A sender's view of its peers' announced transfers (pure Python, no sockets).

Every sender keeps its own view and plans from it; there is no coordinator.
An entry lives until its expected end plus ``entry_ttl_s``; a peer not heard
from (announcement or heartbeat) for ``peer_timeout_s`` is dead and its
entries drop out. ``live()`` is what the planner sees. The view is bounded:
past ``max_entries`` the entries that end soonest are dropped (counted by the
caller through the return value of :meth:`add`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from vllm_ext.ark.fabric import Transfer


@dataclass
class _Entry:
    transfer: Transfer
    peer: str


class PeerView:
    """Announcements by peer, with expiry; thread-safe."""

    def __init__(self, entry_ttl_s: float = 1.0, peer_timeout_s: float = 3.0,
                 max_entries: int = 4096):  # fmt: skip
        if entry_ttl_s < 0 or peer_timeout_s <= 0 or max_entries < 1:
            raise ValueError("entry_ttl_s >= 0, peer_timeout_s > 0 and max_entries >= 1 required")
        self.entry_ttl_s = entry_ttl_s
        self.peer_timeout_s = peer_timeout_s
        self.max_entries = max_entries
        self._entries: dict[str, _Entry] = {}
        self._last_heard: dict[str, float] = {}
        self._lock = threading.Lock()

    def heard(self, peer: str, now: float) -> None:
        """``peer`` is alive at ``now`` (a heartbeat or any valid message)."""
        with self._lock:
            self._last_heard[peer] = max(now, self._last_heard.get(peer, now))

    def add(self, transfer: Transfer, peer: str, now: float) -> int:
        """Insert or replace ``transfer``; returns how many entries overflow pushed out."""
        with self._lock:
            self._last_heard[peer] = max(now, self._last_heard.get(peer, now))
            self._entries[transfer.transfer_id] = _Entry(transfer, peer)
            overflow = len(self._entries) - self.max_entries
            if overflow <= 0:
                return 0
            soonest = sorted(self._entries.values(), key=lambda e: e.transfer.end)[:overflow]
            for entry in soonest:
                del self._entries[entry.transfer.transfer_id]
            return overflow

    def remove(self, transfer_id: str) -> None:
        with self._lock:
            self._entries.pop(transfer_id, None)

    def expire(self, now: float) -> None:
        """Drop ended entries and dead peers (with all their entries)."""
        with self._lock:
            dead = {p for p, t in self._last_heard.items() if now - t > self.peer_timeout_s}
            for peer in dead:
                del self._last_heard[peer]
            self._entries = {
                tid: e
                for tid, e in self._entries.items()
                if e.peer not in dead and e.transfer.end + self.entry_ttl_s >= now
            }

    def live(self, now: float) -> list[Transfer]:
        """Transfers the planner should count at ``now``."""
        self.expire(now)
        with self._lock:
            return [e.transfer for e in self._entries.values()]

    def live_peers(self, now: float) -> list[str]:
        self.expire(now)
        with self._lock:
            return sorted(self._last_heard)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
