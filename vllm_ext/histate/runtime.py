"""Scheduler-side HiState runtime: the index and the policy, no bytes (no vLLM types).

The connector's scheduler half owns one :class:`HiStateRuntime`: a
:class:`~vllm_ext.histate.tiers.TieredCache` with ``keep_payloads=False``
(keys, sizes, tiers, scores) under the one eviction queue per tier. The bytes
are on the worker (:class:`~vllm_ext.histate.worker_store.WorkerStore`), which
applies what this index decides, in order, at the start of the next step:

- :meth:`stored` indexes a key the worker reports copied out; the policy's
  evictions and spills become ``drop`` / ``spill`` operations
  (:meth:`take_ops`), and a copy the index refuses is dropped there too.
- :meth:`plan_load` finds the longest prefix whose KV (vLLM's own device hit,
  else our host tier) and boundary snapshot exist. The worker is sure to hold
  every host item of a plan (items are indexed only once copied, leave only by
  a ``drop`` sent after the plan's load, and a plan is pinned until its load
  is sent); an SSD snapshot is first staged into host memory on the worker, so
  a load never fails on the step (vLLM 0.32 cannot recover a failed
  synchronous load of a hybrid model). A file the worker cannot read or write
  is reported and forgotten here (:meth:`unreadable`, :meth:`spill_failed`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from vllm_ext.common.counters import Counters, CounterSpec, GaugeSpec, HistogramSpec
from vllm_ext.common.log import get_logger
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.counters import COUNTER_SPECS as ALGORITHM_SPECS
from vllm_ext.histate.lookup import BranchTracker, TailIndex, longest_hit
from vllm_ext.histate.policy import (
    BRANCH,
    DECODE_END,
    INTERVAL,
    PROMPT_END,
    Kind,
    kv_key,
    snap_key,
    tail_kv_key,
    tail_snap_key,
)
from vllm_ext.histate.tiers import HOST, SSD, TieredCache
from vllm_ext.histate.worker_store import DROP, SPILL, WorkerStore

logger = get_logger(__name__)

DEVICE = "device"
# depth (full blocks) -> a request's candidate tails there: (length, tail hash), longest first
TailsAt = Callable[[int], Sequence[tuple[int, str]]]
ADAPTER_SPECS = (
    CounterSpec("hit_requests", "requests whose prefix was served (in part) from HiState tiers"),
    CounterSpec("hit_tokens", "prompt tokens restored from HiState tiers instead of recomputed"),
    CounterSpec("kv_blocks_loaded", "KV blocks copied from host memory into the device pool"),
    CounterSpec("snapshots_loaded_host", "recurrent-state snapshots restored from host memory"),
    CounterSpec("snapshots_loaded_ssd", "recurrent-state snapshots restored from the SSD tier"),
    CounterSpec("load_bytes_host", "payload bytes restored from host memory"),
    CounterSpec("load_bytes_ssd", "payload bytes restored from the SSD tier"),
    CounterSpec("load_failures", "snapshot files the worker found unreadable; treated as misses"),
    CounterSpec("kv_blocks_stored", "KV blocks copied out of the device pool into host memory"),
    CounterSpec("snapshots_stored", "boundary snapshots copied out into host memory"),
    CounterSpec("store_bytes_host", "payload bytes stored into host memory"),
    CounterSpec("store_failures", "stores that failed (I/O or internal error); serving continued"),
    CounterSpec(
        "device_snapshots_released",
        "freed device blocks whose snapshot a tier holds, uncached so vLLM reuses them first",
    ),
)
# what users graph: how full each tier is, how long a hit waits for its restore
GAUGE_SPECS = (
    GaugeSpec("tier_used_bytes", "bytes held by each HiState tier (host, ssd)", label="tier"),
    GaugeSpec("tier_capacity_bytes", "capacity of each HiState tier (host, ssd)", label="tier"),
)
HISTOGRAM_SPECS = (
    HistogramSpec(
        "restore_seconds",
        "from a request's first hit in HiState's tiers until its restore is scheduled "
        "(an SSD snapshot's read included)",
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    ),
)
COUNTER_SPECS = ALGORITHM_SPECS + ADAPTER_SPECS + GAUGE_SPECS + HISTOGRAM_SPECS


@dataclass
class LoadPlan:
    """A hit: KV of blocks ``first..blocks-1`` (host tier) and the snapshot at its end.

    ``snapshot_tier`` is ``"host"``, or ``"ssd"``: then the worker reads the file
    into the request's staging buffer first (:data:`~vllm_ext.histate.worker_store.STAGE`).
    A tail hit ends ``tokens - blocks * block_size`` tokens into block ``blocks``:
    ``tail_kv_key`` holds that partial block's KV and the snapshot is the state
    at exactly ``tokens``.
    """

    first: int
    blocks: int
    kv_keys: list[str]
    snapshot_key: str
    snapshot_tier: str
    tokens: int = 0  # where the hit ends; 0 = ``blocks`` full blocks
    tail_kv_key: str | None = None

    def keys(self) -> list[str]:
        tail = [self.tail_kv_key] if self.tail_kv_key else []
        return [*self.kv_keys, *tail, self.snapshot_key]

    def end(self, block_size: int) -> int:
        """Tokens computed once the hit is loaded."""
        return self.tokens or self.blocks * block_size


def snapshot_reason(
    boundary: int, num_prompt_tokens: int, block_size: int, interval: int,
    branch: int | None = None,
) -> str | None:  # fmt: skip
    """Why a state at the end of block ``boundary - 1`` (``boundary`` blocks) is worth keeping.

    ``prompt_end`` is the deepest boundary a request with the same prompt can
    hit (vLLM never serves the last prompt token from cache); boundaries past
    it were crossed while decoding (``decode_end``: the next turn of a
    conversation hits there). None: not a candidate.
    """
    if boundary < 1:
        return None
    if branch is not None and boundary == branch:
        return BRANCH
    prompt_end = (num_prompt_tokens - 1) // block_size
    if boundary > prompt_end:
        return DECODE_END
    if boundary == prompt_end:
        return PROMPT_END
    return INTERVAL if boundary % interval == 0 else None


class HiStateRuntime:
    """The scheduler's index of one engine's tiers: keys, sizes, tiers, scores; no bytes.

    Args:
        config: HiState settings.
        counters: where everything is counted (must declare :data:`COUNTER_SPECS`).
        ssd_files: snapshot files found at start (key -> payload bytes), from
            :func:`~vllm_ext.histate.snapfile.scan`.
        local_worker: the worker's store when it runs in this process, else None
            (only :meth:`drain` and :meth:`close` use it: tests, in-process benchmarks).
    """

    def __init__(
        self, config: HiStateConfig, counters: Counters, ssd_files: Mapping[str, int] = {},
        local_worker: Callable[[], WorkerStore | None] = lambda: None,
    ):  # fmt: skip
        self.config = config
        self.counters = counters
        # no folder, no SSD tier (the worker would refuse every spill)
        index = config if config.directory is not None else replace(config, ssd_bytes=0)
        self.tiers = TieredCache(index, keep_payloads=False, counters=counters)
        self.branches = BranchTracker()
        self.tails = TailIndex()
        self._t0 = time.monotonic()
        self._local_worker = local_worker
        # files that did not fit go at the first step
        self._ops: list[tuple[str, str, str]] = [
            (DROP, key, "") for key in self.tiers.adopt(dict(ssd_files))
        ]

    def now(self) -> float:
        """Seconds since start (the policy's clock)."""
        return time.monotonic() - self._t0

    def queue_op(self, op: tuple[str, str, str]) -> None:
        """Send ``op`` to the worker after those decided before it."""
        self._ops.append(op)

    def take_ops(self) -> list[tuple[str, str, str]]:
        """Tier operations for the worker, in the order decided (the next step's metadata)."""
        ops, self._ops = self._ops, []
        return ops

    # ---- hits
    def plan_load(
        self, chain: Sequence[str], local_blocks: int, max_blocks: int,
        tails: TailsAt | None = None, block_size: int = 0,
    ) -> LoadPlan | None:  # fmt: skip
        """The longest hit beyond vLLM's own ``local_blocks``; None = miss.

        ``tails(depth)`` names the request's candidate tails after ``depth`` full
        blocks (``(length, tail hash)``, longest first, each ending before the
        last prompt token); a tail hit needs the KV of every block before it.
        """
        device = set(chain[:local_blocks])
        hit = longest_hit(
            chain,
            lambda h: DEVICE if h in device else self.tiers.tier_of(kv_key(h)),
            lambda h: self.tiers.tier_of(snap_key(h)),
            max_blocks=max_blocks,
        )
        plan = None
        if hit.blocks > local_blocks and hit.snapshot_tier is not None:
            kv = [kv_key(h) for h in chain[local_blocks : hit.blocks]]
            plan = LoadPlan(local_blocks, hit.blocks, kv, snap_key(chain[hit.blocks - 1]),
                            hit.snapshot_tier)  # fmt: skip
        if tails is None:
            return plan
        best = hit.blocks if plan is not None else local_blocks
        # a tail after `depth` blocks ends inside block `depth`: deeper always wins
        for depth in range(min(hit.kv_blocks_present, max_blocks), best - 1, -1):
            tail = self._tail_at(depth, tails)
            if tail is not None:
                kv = [kv_key(h) for h in chain[local_blocks:depth]]
                length, name, tier = tail
                return LoadPlan(local_blocks, depth, kv, tail_snap_key(name), tier,
                                depth * block_size + length, tail_kv_key(name))  # fmt: skip
        return plan

    def _tail_at(self, depth: int, tails: TailsAt) -> tuple[int, str, str] | None:
        """The longest tail after ``depth`` blocks with both items in a tier."""
        for length, name in tails(depth):
            snap = self.tiers.tier_of(tail_snap_key(name))
            if snap is not None and self.tiers.tier_of(tail_kv_key(name)) == HOST:
                return length, name, snap
        return None

    def add_tail(self, parent: str, length: int, name: str) -> None:
        """Both items of a tail are indexed: offer it to lookups."""
        self.tails.add(parent, length, name)

    def _forget(self, key: str) -> None:
        """``key`` left every tier: a tail it belonged to is no longer offered."""
        for prefix in (tail_snap_key(""), tail_kv_key("")):
            if key.startswith(prefix):
                self.tails.discard(key[len(prefix) :])

    def pin(self, plan: LoadPlan) -> None:
        """Keep a planned hit's items from eviction until its load is sent."""
        for key in plan.keys():
            self.tiers.pin(key)

    def unpin(self, plan: LoadPlan) -> None:
        for key in plan.keys():
            self.tiers.unpin(key)

    def record_hit(self, plan: LoadPlan, block_size: int) -> None:
        """Count a hit the scheduler committed to; an access for the policy."""
        now = self.now()
        kv_bytes = 0
        kv_keys = plan.keys()[:-1]
        for key in kv_keys:
            item = self.tiers.host.get(key)
            kv_bytes += item.nbytes if item is not None else 0
            self.tiers.touch(key, now)
        snap = self.tiers.host.get(plan.snapshot_key) or self.tiers.ssd.get(plan.snapshot_key)
        self.tiers.touch(plan.snapshot_key, now)
        host = plan.snapshot_tier == HOST
        self.counters.inc("hit_requests")
        self.counters.inc("hit_tokens", plan.end(block_size) - plan.first * block_size)
        self.counters.inc("kv_blocks_loaded", len(kv_keys))
        self.counters.inc("snapshots_loaded_host" if host else "snapshots_loaded_ssd")
        self.counters.inc("host_hits", len(kv_keys) + host)
        self.counters.inc("ssd_hits", not host)
        self.counters.inc("load_bytes_host", kv_bytes + (snap.nbytes if snap and host else 0))
        self.counters.inc("load_bytes_ssd", snap.nbytes if snap and not host else 0)

    def has(self, key: str) -> bool:
        """Is ``key`` in a tier already (a store of it would only touch it)?"""
        return self.tiers.tier_of(key) is not None

    def admit(self, reason: str | None) -> bool:
        return reason is not None and self.tiers.admit(reason)

    # ---- what the worker reports
    def stored(
        self, key: str, kind: Kind, nbytes: int, position: int, recompute_tokens: int
    ) -> bool:
        """The worker holds a host copy of ``key``: index it, evicting (and spilling) by policy.

        A copy the index does not take (no room, an error) is dropped on the worker.
        """
        try:
            result = self.tiers.store(
                key, kind, nbytes, self.now(), recompute_tokens=recompute_tokens,
                position=position,
            )  # fmt: skip
        except Exception:  # noqa: BLE001 - a store is best effort; serving goes on
            self.counters.inc("store_failures")
            logger.exception("HiState: indexing %s failed; dropped", key)
            result = None
        if result is None or not result.stored:
            self._ops.append((DROP, key, ""))
            return False
        self.counters.inc("store_bytes_host", nbytes)
        self.counters.inc("kv_blocks_stored" if kind is Kind.KV else "snapshots_stored")
        # spills first: an item spilled and then evicted from the SSD in one round
        # must be written before its file is deleted
        self._ops += [(SPILL, item.key, "") for item in result.spilled]
        self._ops += [(DROP, item.key, "") for item in result.evicted]
        for item in result.evicted:
            self._forget(item.key)
        return True

    def spill_failed(self, key: str, code: int, nbytes: int) -> None:
        """The worker could not write ``key``'s file: forget it (ENOSPC: shrink the SSD tier)."""
        victims = self.tiers.write_failed(key, code, nbytes) if nbytes > 0 else []
        self._ops += [(DROP, item.key, "") for item in victims]
        for item in victims:
            self._forget(item.key)
        if self.tiers.tier_of(key) is None:
            self._forget(key)

    def unreadable(self, key: str) -> None:
        """A file could not be read back (corrupt, EIO, gone): never offer it again."""
        self.counters.inc("load_failures")
        self.tiers.remove(key)
        self._forget(key)
        self._ops.append((DROP, key, ""))

    # ---- lifecycle
    def drain(self) -> None:
        """Wait for the worker's SSD queue when the worker runs in this process (tests,
        in-process benchmarks); stores themselves are indexed when the worker reports them."""
        worker = self._local_worker()
        if worker is not None:
            worker.settle()

    def close(self, persist: bool = True) -> None:
        """Close the worker's store when it runs in this process (``persist``: host snapshots
        to SSD now, not at interpreter exit); a worker elsewhere closes at its shutdown."""
        worker = self._local_worker()
        if worker is not None:
            worker.close(persist=persist)

    def check_idle(self) -> None:
        """Raise AssertionError if an item is still pinned or a tier's accounting is off."""
        self.tiers.check_invariants()
        for tier in (self.tiers.host, self.tiers.ssd):
            assert tier.pinned_bytes == 0, f"{tier.pinned_bytes} bytes still pinned"


__all__ = ["COUNTER_SPECS", "DEVICE", "HOST", "SSD", "HiStateRuntime", "LoadPlan"]
