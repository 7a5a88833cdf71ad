"""Host-memory and SSD tiers of HiState, driven by one policy (no vLLM types).

:class:`TieredCache` keeps KV blocks and snapshots in a host tier and
snapshots in an SSD tier. Each tier is an
:class:`~vllm_ext.histate.queue.EvictionQueue` with the same policy, so KV
blocks and snapshots compete in one queue for host memory. A snapshot evicted
from host memory spills to the SSD while ``spill_to_ssd`` is on and the SSD
tier has a capacity (SSD victims are then chosen by the same score); an
evicted KV block is dropped (fast memory is for KV; a KV block is no use on a
slow tier because a hit reads every matching block).

Payloads are opaque bytes. With ``keep_payloads=False`` and no
:class:`~vllm_ext.histate.snapfile.SnapshotStore` the tiers are an index only:
the simulator, and the connector's scheduler half, whose worker holds the
bytes (:mod:`vllm_ext.histate.worker_store`) and applies the spills and
evictions :meth:`TieredCache.store` returns.

Thread safety: every public method takes one lock; SSD file writes and
deletes run outside it, so a background store thread never blocks a lookup on
disk I/O. A key can be in the SSD queue before its file is complete: a read
then misses, which is always allowed.
"""

from __future__ import annotations

import errno
import threading
from dataclasses import dataclass, field

from vllm_ext.common.counters import Counters
from vllm_ext.common.log import get_logger
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.counters import new_counters
from vllm_ext.histate.policy import Item, Kind, Policy, make_policy
from vllm_ext.histate.queue import EvictionQueue
from vllm_ext.histate.snapfile import SnapshotStore

logger = get_logger(__name__)

HOST, SSD = "host", "ssd"


@dataclass
class StoreResult:
    """What one :meth:`TieredCache.store` did."""

    stored: bool
    evicted: list[Item] = field(default_factory=list)  # gone from every tier
    spilled: list[Item] = field(default_factory=list)  # moved host -> SSD


class TieredCache:
    """Host + SSD tiers under one policy.

    Args:
        config: capacities, policy, slack, spill switch.
        ssd_store: files backing the SSD tier; None = byte accounting only.
        keep_payloads: keep host payload bytes (False in the simulator).
        counters: HiState counters. Default: the store's, else a fresh set.
        policy: overrides ``make_policy(config)`` (the simulator's ablations).
        ssd_policy: the SSD tier's own instance when a policy keeps per-tier state
            (vLLM's lru/arc in the simulator). Default: ``policy``.
    """

    def __init__(
        self, config: HiStateConfig, *, ssd_store: SnapshotStore | None = None,
        keep_payloads: bool = True, counters: Counters | None = None,
        policy: Policy | None = None, ssd_policy: Policy | None = None,
    ):  # fmt: skip
        self.config = config
        self.policy = policy or make_policy(config)
        # one set of counters for both tiers: the store's own, unless given
        self.counters = counters or (
            ssd_store.counters if ssd_store is not None else new_counters()
        )
        self.ssd_store = ssd_store
        # without files an SSD tier holding real payloads would offer hits it cannot
        # serve: only the simulator (no payloads) keeps an accounting-only SSD tier
        has_ssd = config.spill_to_ssd and (ssd_store is not None or not keep_payloads)
        ssd_cap = config.ssd_bytes if has_ssd else 0
        self.host = EvictionQueue(
            self.policy, config.host_bytes, config.evict_slack, spills=ssd_cap > 0
        )
        self.ssd = EvictionQueue(ssd_policy or self.policy, ssd_cap, config.evict_slack)
        self._payloads: dict[str, bytes] | None = {} if keep_payloads else None
        self._lock = threading.RLock()
        if ssd_store is not None:
            self._adopt_ssd_files()

    def admit(self, reason: str) -> bool:
        """Does the policy store a snapshot created for ``reason``?"""
        return self.policy.admit(reason)

    def tier_of(self, key: str) -> str | None:
        """``"host"``, ``"ssd"`` or None."""
        with self._lock:
            if key in self.host:
                return HOST
            return SSD if key in self.ssd else None

    def store(
        self, key: str, kind: Kind, nbytes: int, now: float, *, recompute_tokens: int = 0,
        position: int = 0, payload: bytes | None = None,
    ) -> StoreResult:  # fmt: skip
        """Put an item into host memory, evicting (and spilling) by policy.

        A key already in a tier is only touched. Returns what moved, so the
        caller can account I/O; ``stored`` is False when there is no room
        (everything pinned, or the item exceeds the capacity).
        """
        deletes: list[str] = []
        writes: list[tuple[str, bytes]] = []
        with self._lock:
            if self.host.touch(key, now, recompute_tokens, position) or self.ssd.touch(
                key, now, recompute_tokens, position
            ):
                return StoreResult(True)
            item = Item(key, kind, nbytes, now, recompute_tokens, position)
            ok, victims = self.host.insert(item)
            if not ok:
                self.counters.inc("store_rejected")
                return StoreResult(False)
            if self._payloads is not None and payload is not None:
                self._payloads[key] = payload
            result = StoreResult(True)
            self.counters.inc("host_evictions", len(victims))
            for victim in victims:
                data = self._payloads.pop(victim.key, None) if self._payloads is not None else None
                if victim.kind is Kind.SNAPSHOT and self._spill(victim, result, deletes):
                    if data is not None:
                        writes.append((victim.key, data))
                else:
                    result.evicted.append(victim)
        self._disk_io(writes, deletes)
        return result

    def touch(
        self, key: str, now: float, recompute_tokens: int | None = None,
        position: int | None = None,
    ) -> str | None:  # fmt: skip
        """Record an access; the tier holding ``key`` or None."""
        with self._lock:
            if self.host.touch(key, now, recompute_tokens, position):
                return HOST
            if self.ssd.touch(key, now, recompute_tokens, position):
                return SSD
            return None

    def pin(self, key: str) -> str | None:
        """Protect ``key`` from eviction while it is read; its tier or None."""
        with self._lock:
            if self.host.pin(key):
                return HOST
            return SSD if self.ssd.pin(key) else None

    def unpin(self, key: str) -> None:
        """Release a :meth:`pin`."""
        with self._lock:
            self.host.unpin(key)
            self.ssd.unpin(key)

    def load(self, key: str) -> bytes | None:
        """The payload of ``key`` from host memory or the SSD; None = miss (never raises)."""
        with self._lock:
            if key in self.host:
                self.counters.inc("host_hits")
                return None if self._payloads is None else self._payloads.get(key)
            on_ssd = key in self.ssd
        if not on_ssd or self.ssd_store is None:
            return None
        data = self.ssd_store.get(key)
        if data is None:
            # corrupt or vanished: forget it so it is not offered again
            with self._lock:
                self.ssd.remove(key)
        else:
            self.counters.inc("ssd_hits")
        return data

    def remove(self, key: str) -> None:
        """Drop ``key`` from every tier (e.g. a failed load)."""
        with self._lock:
            self.host.remove(key)
            on_ssd = self.ssd.remove(key) is not None
            if self._payloads is not None:
                self._payloads.pop(key, None)
        if on_ssd and self.ssd_store is not None:
            self.ssd_store.delete(key)

    def check_invariants(self) -> None:
        """Raise AssertionError if a tier's accounting is broken or a key is in both."""
        with self._lock:
            self.host.check_invariants()
            self.ssd.check_invariants()
            both = {i.key for i in self.host} & {i.key for i in self.ssd}
            assert not both, f"keys in both tiers: {sorted(both)[:5]}"
            assert all(i.kind is Kind.SNAPSHOT for i in self.ssd)

    def _spill(self, victim: Item, result: StoreResult, deletes: list[str]) -> bool:
        if self.ssd.capacity == 0:
            return False
        victim.pins = 0
        ok, ssd_victims = self.ssd.insert(victim)
        self.counters.inc("ssd_evictions", len(ssd_victims))
        result.evicted.extend(ssd_victims)
        deletes.extend(v.key for v in ssd_victims)
        if ok:
            self.counters.inc("spills")
            result.spilled.append(victim)
        return ok

    def _disk_io(self, writes: list[tuple[str, bytes]], deletes: list[str]) -> None:
        if self.ssd_store is None:
            return
        for key in deletes:
            self.ssd_store.delete(key)
        for key, data in writes:
            code = self.ssd_store.write(key, data)
            if code == 0:
                continue
            for victim in self.write_failed(key, code, len(data)):
                self.ssd_store.delete(victim.key)

    def write_failed(self, key: str, code: int, nbytes: int) -> list[Item]:
        """A spill of ``key`` was not written (errno ``code``): forget it; on ``ENOSPC``
        also shrink the SSD tier (:meth:`_shrink_ssd`). Returns the victims, whose files
        the caller deletes."""
        with self._lock:
            self.ssd.remove(key)
            return self._shrink_ssd(nbytes) if code == errno.ENOSPC else []

    def _shrink_ssd(self, nbytes: int) -> list[Item]:
        """The disk refused ``nbytes`` more: cap the tier at what it holds, make room for that.

        ``ssd_bytes`` is a promise the disk may not keep (other files share it): past
        ENOSPC every later spill would fail while the old files stayed. The lower
        capacity holds until restart; victims leave by the tier's policy.
        """
        old = self.ssd.capacity
        self.ssd.capacity = min(old, self.ssd.used_bytes)
        victims = self.ssd.make_room(nbytes)
        self.counters.inc("ssd_disk_full")
        self.counters.inc("ssd_capacity_shrunk_bytes", old - self.ssd.capacity)
        self.counters.inc("ssd_evictions", len(victims))
        logger.warning(
            "HiState: SSD disk full; SSD tier capacity lowered from %d to %d bytes, "
            "%d snapshots evicted",
            old, self.ssd.capacity, len(victims),
        )  # fmt: skip
        return victims

    def _adopt_ssd_files(self) -> None:
        """Register snapshot files found at start (a restart finds them again)."""
        assert self.ssd_store is not None
        for key in self.adopt(self.ssd_store.sizes()):
            self.ssd_store.delete(key)

    def adopt(self, sizes: dict[str, int]) -> list[str]:
        """Put snapshot files found at start (key -> payload bytes) into the SSD tier.

        Returns the keys that did not fit (the caller deletes their files).
        """
        extra: list[str] = []
        with self._lock:
            for key, nbytes in sizes.items():
                if nbytes <= 0:
                    continue
                ok, victims = self.ssd.insert(Item(key, Kind.SNAPSHOT, nbytes, 0.0))
                extra.extend(v.key for v in victims)
                if not ok:
                    extra.append(key)
        logger.info("HiState: adopted %d snapshot files into the SSD tier", len(self.ssd))
        return extra
