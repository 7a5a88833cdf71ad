"""Keep historical recurrent-state snapshots off the device block pool (vLLM 0.32-0.34).

In vLLM's align mode a hybrid model's snapshots live in device blocks of the
same pool and the same LRU free queue as attention KV, so old snapshots evict
live attention prefixes. Once HiState holds a snapshot in host memory or on
SSD, the device copy is redundant: a later hit loads it back (one snapshot per
hit, a fixed size). So when a Mamba-group block whose snapshot HiState holds
is freed, its prefix-cache hash is dropped first; vLLM then treats it as an
uncached block and reuses it before any cached KV block.

vLLM has no eviction hook, so this is a registered patch (patches/README.md):
the connector's ``bind_kv_cache_manager`` hands us the scheduler's
``KVCacheManager``; every ``MambaManager`` in its coordinator gets its
``block_pool`` wrapped by :class:`SnapshotsOffDevice` (an instance attribute,
no vLLM class is patched). Everything else is delegated to the real pool.
``BlockPool._maybe_evict_cached_block`` is private: the wrap is skipped, with a
warning, on a vLLM whose seams (``vllm_ext.common.compat``) do not hold.

The connector also applies :mod:`vllm_ext.patches.mamba_external_state_count`
(vLLM 0.32 under-counts the Mamba block a connector hit takes); without it a
hit into a full pool crashes the engine, with or without releasing snapshots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from vllm_ext.common import compat
from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

# block -> does HiState hold this block's snapshot in one of its tiers?
HeldBy = Callable[[object], bool]


class SnapshotsOffDevice:
    """A Mamba manager's view of the block pool that releases held snapshots on free."""

    def __init__(self, pool, held: HeldBy, on_release: Callable[[int], None] | None = None):
        self.__dict__["_pool"] = pool
        self.__dict__["_held"] = held
        self.__dict__["_on_release"] = on_release

    def free_blocks(self, ordered_blocks: Iterable) -> None:
        blocks = list(ordered_blocks)
        released = 0
        extra = getattr(self._pool, "cached_block_hashes_by_block", {})
        for block in blocks:
            # only blocks this free returns to the queue; a shared block stays cached, and
            # so does one cached under further (e.g. partial-block) hashes we cannot check
            if (
                block.ref_cnt == 1
                and block.block_hash is not None
                and block.block_id not in extra
                and self._held(block)
            ):
                released += self._pool._maybe_evict_cached_block(block)
        self._pool.free_blocks(blocks)
        if released and self._on_release is not None:
            self._on_release(released)

    def __getattr__(self, name: str):
        return getattr(self._pool, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._pool, name, value)

    # the coordinator resets "each manager's pool once" (dict.fromkeys over the managers'
    # pools): the view and the pool it wraps are one pool there
    def __eq__(self, other) -> bool:
        return other is self or other is self._pool

    def __hash__(self) -> int:
        return hash(self._pool)


def needed() -> bool:
    """True when the pool and manager seams this patch relies on hold (SEAMS, histate)."""
    names = ("BlockPool._maybe_evict_cached_block", "BlockPool.free_blocks")
    return not [
        line for line in compat.problems("histate") if any(name in line for name in names)
    ]


def _mamba_managers(kv_cache_manager) -> list:
    return [
        m for m in kv_cache_manager.coordinator.single_type_managers if isinstance(m, MambaManager)
    ]


def is_applied(kv_cache_manager) -> bool:
    managers = _mamba_managers(kv_cache_manager)
    return bool(managers) and all(isinstance(m.block_pool, SnapshotsOffDevice) for m in managers)


def apply(kv_cache_manager, held: HeldBy, on_release: Callable[[int], None] | None = None) -> int:
    """Wrap the block pool of every Mamba manager once; returns how many were wrapped now."""
    if not needed():
        logger.warning(
            "HiState: this vLLM's BlockPool lacks the seams to release snapshots "
            "(_maybe_evict_cached_block, free_blocks); snapshots stay in device memory"
        )
        return 0
    compat.check_instance("histate", kv_cache_manager, "KVCacheManager")
    wrapped = 0
    for manager in _mamba_managers(kv_cache_manager):
        if not isinstance(manager.block_pool, SnapshotsOffDevice):
            manager.block_pool = SnapshotsOffDevice(manager.block_pool, held, on_release)
            wrapped += 1
    return wrapped


def revert(kv_cache_manager) -> None:
    for manager in _mamba_managers(kv_cache_manager):
        if isinstance(manager.block_pool, SnapshotsOffDevice):
            manager.block_pool = manager.block_pool._pool
