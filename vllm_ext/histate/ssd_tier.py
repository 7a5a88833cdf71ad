"""The SSD tier's folder and size as served: ``~`` expanded, capacity capped by the disk.

``ssd_bytes`` is what the user allows; the disk may hold less. The tier's
capacity is ``min(ssd_bytes, free space on the folder's disk + bytes already in
the folder)`` (the folder's own files are ours to replace), decided once at
start and logged with the folder, so a default of 256 GiB on a nearly full disk
neither promises the index what it cannot keep nor fills the disk. Later
shortfalls (other writers) are handled by ENOSPC shrinking (tiers.py). No vLLM.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from vllm_ext.common.log import get_logger
from vllm_ext.histate.config import HiStateConfig

logger = get_logger(__name__)
MIB = 1 << 20


def free_bytes(path: str) -> int:
    """Free bytes on the disk that holds ``path`` (its nearest existing ancestor)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return shutil.disk_usage(probe).free


def folder_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


def sized_ssd_tier(config: HiStateConfig) -> HiStateConfig:
    """``config`` with ``directory`` expanded (``~``) and ``ssd_bytes`` capped by the disk."""
    if config.directory is None or config.ssd_bytes == 0:
        return config
    directory = os.path.abspath(os.path.expanduser(config.directory))
    available = free_bytes(directory) + folder_bytes(directory)
    capacity = min(config.ssd_bytes, available)
    logger.info(
        "HiState: SSD tier in %s, capacity %d MiB (ssd_bytes %d MiB; its disk has %d MiB "
        "free or already HiState's)",
        directory, capacity // MIB, config.ssd_bytes // MIB, available // MIB,
    )  # fmt: skip
    return dataclasses.replace(config, directory=directory, ssd_bytes=capacity)
