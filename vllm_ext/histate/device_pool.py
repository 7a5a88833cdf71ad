"""HiState's device-pool policy, applied through a registered patch.

The mechanism (wrapping each Mamba manager's ``block_pool`` so a freed block
whose snapshot a tier holds loses its prefix-cache entry) lives in
``patches/mamba_block_pool_release.py``, listed in ``patches/README.md``.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_ext.patches import mamba_block_pool_release

HeldBy = mamba_block_pool_release.HeldBy
SnapshotsOffDevice = mamba_block_pool_release.SnapshotsOffDevice


def keep_snapshots_off_device(
    kv_cache_manager, held: HeldBy, on_release: Callable[[int], None] | None = None
) -> int:
    """Release held snapshots' device blocks first; returns how many pools were wrapped."""
    return mamba_block_pool_release.apply(kv_cache_manager, held, on_release)
