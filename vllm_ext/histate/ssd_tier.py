"""The SSD tier's folder and size as served: a user cache folder by default, capacity
capped by the disk.

Without ``directory`` the tier lives in the user's cache folder
(:func:`default_directory`), never in whatever folder the server was started
from. ``ssd_bytes`` is what the user allows; the disk may hold less. The tier's
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


def default_directory(environ=os.environ) -> str:
    """``$XDG_CACHE_HOME/vllm_ext/histate``, else ``~/.cache/vllm_ext/histate``."""
    base = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative value is to be ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vllm_ext", "histate")


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


def sized_ssd_tier(config: HiStateConfig, environ=os.environ) -> HiStateConfig:
    """``config`` with its SSD folder decided (the default when unset) and ``ssd_bytes``
    capped by the disk; unchanged without an SSD tier (``ssd_bytes`` 0)."""
    if config.ssd_bytes == 0:
        return config
    directory = os.path.abspath(config.directory or default_directory(environ))
    available = free_bytes(directory) + folder_bytes(directory)
    capacity = min(config.ssd_bytes, available)
    logger.info(
        "HiState: SSD tier in %s, capacity %d MiB (ssd_bytes %d MiB; its disk has %d MiB "
        "free or already HiState's)",
        directory, capacity // MIB, config.ssd_bytes // MIB, available // MIB,
    )  # fmt: skip
    return dataclasses.replace(config, directory=directory, ssd_bytes=capacity)
