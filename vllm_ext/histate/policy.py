"""Cached items and the eviction/admission policies of HiState's tiers (no vLLM types).

An :class:`Item` is one KV block or one recurrent-state snapshot, keyed by the
block hash of the prefix it ends. Every policy answers two questions:

- **admission** (:meth:`Policy.admit`): may a snapshot created for ``reason``
  (``interval``, ``prompt_end``, ``decode_end``, ``branch``) be stored at all?
- **eviction order**: ``score(item)`` for policies whose score depends on the
  item alone (``static``; the queue keeps them in a heap), or ``order(items)``
  for policies that normalise over the current candidates (Marconi).

Policies (the simulator and the connector run these same classes):

- ``lru``: admit every snapshot; evict the least recently used item.
- ``marconi`` (Pan et al., MLSys'25, arXiv 2411.19379): admit snapshots only
  at branch points of the prefix tree and at the last decoded token; evict the
  lowest ``S = recency + alpha * flop_efficiency``, both min-max normalised to
  [0, 1] over the evictable items, flop efficiency = prefill seconds saved per
  byte (seconds are FLOPs at a fixed MFU; the quadratic attention term is
  included, which is what makes long-prefix states valuable in Marconi).
- ``histate``: admit every snapshot; evict the lowest
  ``H = L + w * loss_s / MiB freed`` (GreedyDual-Size, Cao & Irani 1997).
  ``loss_s`` is what a future hit loses if the item leaves this tier: a
  snapshot that spills from host memory to the SSD loses one SSD read; a KV
  block, or a snapshot leaving its last tier, loses the prefill of the extra
  tokens recomputed. ``L`` is the queue's clock: it starts at 0 and rises to
  the ``H`` of each evicted item, so an item's "last access" is the clock
  value when it was stored or touched, and time and loss share one unit
  (seconds of loss per MiB) with no dependence on when the server started.
  ``H`` is fixed between accesses, so a heap orders it in O(log n).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum

from vllm_ext.histate.config import HiStateConfig

MIB = float(1 << 20)
# why a snapshot exists at a position; policies admit by reason
INTERVAL, PROMPT_END, DECODE_END, BRANCH = "interval", "prompt_end", "decode_end", "branch"
REASONS = (INTERVAL, PROMPT_END, DECODE_END, BRANCH)


def kv_key(block_hash: str) -> str:
    """Queue/store key of the KV block whose prefix ends with ``block_hash``."""
    return "kv:" + block_hash


def snap_key(block_hash: str) -> str:
    """Queue/store key of the snapshot taken at the end of block ``block_hash``."""
    return "snap:" + block_hash


def tail_kv_key(tail_hash: str) -> str:
    """Key of a tail's partial KV block (the tokens past the last full block it ends)."""
    return kv_key("t" + tail_hash)


def tail_snap_key(tail_hash: str) -> str:
    """Key of the state at a tail's exact end (a snapshot: spills to the SSD like the others)."""
    return snap_key("t" + tail_hash)


class Kind(str, Enum):  # noqa: UP042 (StrEnum would change str(kind), which logs and keys use)
    """What an item holds."""

    KV = "kv"
    SNAPSHOT = "snapshot"


@dataclass(slots=True)
class Item:
    """One cached object as the eviction queue sees it.

    Args:
        key: unique key (e.g. ``("kv", block_hash)`` or ``("snap", block_hash)``).
        kind: KV block or snapshot.
        nbytes: bytes freed when it is evicted (> 0).
        last_access: seconds on the queue owner's clock.
        recompute_tokens: extra tokens recomputed by a future hit if this item is removed.
        position: token position where the item's prefix ends (prices the recompute).
        pins: readers in flight; a pinned item is never evicted.
        stamp: version, bumped on every update (lazy heap invalidation).
        score: the queue's score at the last update (static policies).
    """

    key: Hashable
    kind: Kind
    nbytes: int
    last_access: float
    recompute_tokens: int = 0
    position: int = 0
    pins: int = 0
    stamp: int = 0
    score: float = 0.0

    def __post_init__(self) -> None:
        if self.nbytes <= 0:
            raise ValueError(f"item {self.key!r}: nbytes must be > 0, got {self.nbytes}")
        if self.recompute_tokens < 0 or self.position < 0:
            raise ValueError(f"item {self.key!r}: recompute_tokens and position must be >= 0")


class Policy:
    """Base policy: admits every snapshot; subclasses define the order."""

    name = "base"
    # True: score(item) is fixed between updates, so the queue may keep a heap
    static = True

    def __init__(self, config: HiStateConfig):
        self.config = config

    def admit(self, reason: str) -> bool:
        """May a snapshot created for ``reason`` be stored?"""
        if reason not in REASONS:
            raise ValueError(f"unknown snapshot reason {reason!r}; expected one of {REASONS}")
        return True

    def score(self, item: Item, clock: float = 0.0, spills: bool = False) -> float:
        """Eviction score; lowest goes first (static policies only).

        Args:
            item: the item, just stored or touched.
            clock: the queue's clock ``L`` (GreedyDual inflation; see the module doc).
            spills: the queue spills evicted snapshots to a slower tier.
        """
        raise NotImplementedError

    def order(self, items: Sequence[Item]) -> list[Item]:
        """``items`` in eviction order, first = evicted first."""
        return sorted(items, key=self.score)

    def observe(self, item: Item) -> None:
        """The queue stored or touched ``item`` (for policies that keep access history)."""

    def loss_seconds(self, item: Item, spills: bool) -> float:
        """Seconds a future hit loses if ``item`` leaves a tier (spilling or not)."""
        if spills and item.kind is Kind.SNAPSHOT:
            return self.config.ssd_read_seconds(item.nbytes)
        return self.recompute_seconds(item)

    def recompute_seconds(self, item: Item) -> float:
        """Prefill seconds a future hit loses if ``item`` is removed."""
        return self.config.recompute_seconds(item.recompute_tokens, item.position)


class LruPolicy(Policy):
    """Least recently used first; every snapshot admitted."""

    name = "lru"

    def score(self, item: Item, clock: float = 0.0, spills: bool = False) -> float:
        return item.last_access


class HiStatePolicy(Policy):
    """GreedyDual-Size on loss: ``clock + w * loss_seconds / MiB``; every snapshot admitted."""

    name = "histate"

    def score(self, item: Item, clock: float = 0.0, spills: bool = False) -> float:
        loss = self.loss_seconds(item, spills)
        return clock + self.config.time_weight * loss / (item.nbytes / MIB)


class MarconiPolicy(Policy):
    """Branch-point / last-token admission; recency + alpha * FLOP efficiency."""

    name = "marconi"
    # min-max normalisation over the candidates changes as items come and go
    static = False

    def admit(self, reason: str) -> bool:
        super().admit(reason)
        return reason in (BRANCH, DECODE_END)

    def score(self, item: Item, clock: float = 0.0, spills: bool = False) -> float:
        raise TypeError("Marconi scores are relative to the candidates; use order()")

    def order(self, items: Sequence[Item]) -> list[Item]:
        if not items:
            return []
        recency = [item.last_access for item in items]
        efficiency = [self.recompute_seconds(item) / item.nbytes for item in items]
        r_lo, r_span = min(recency), (max(recency) - min(recency)) or 1.0
        e_lo, e_span = min(efficiency), (max(efficiency) - min(efficiency)) or 1.0
        alpha = self.config.marconi_alpha
        scores = [
            (r - r_lo) / r_span + alpha * (e - e_lo) / e_span
            for r, e in zip(recency, efficiency, strict=True)
        ]
        ranked = sorted(range(len(items)), key=scores.__getitem__)
        return [items[i] for i in ranked]


_POLICIES = {cls.name: cls for cls in (LruPolicy, MarconiPolicy, HiStatePolicy)}


def make_policy(config: HiStateConfig, name: str | None = None) -> Policy:
    """The policy named ``name`` (default ``config.policy``)."""
    name = name or config.policy
    if name not in _POLICIES:
        raise ValueError(f"unknown HiState policy {name!r}; expected one of {sorted(_POLICIES)}")
    return _POLICIES[name](config)
