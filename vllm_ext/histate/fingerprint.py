"""A cheap fingerprint of a checkpoint's weights, for the snapshot namespace (no vLLM).

The namespace's model path and revision do not change when the weights at
that path are replaced in place (a re-export, a fine-tune written over the
old one): snapshots written for the old weights would then load into the new
model and decode wrong tokens. The fingerprint hashes, per weight file, its
name and size, the safetensors header (tensor names, dtypes, shapes,
offsets) and a few small windows of tensor bytes spread over the file, so
reading it costs a few hundred KiB however large the checkpoint. It is cached
per checkpoint and recomputed when a file's size or mtime changes.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES_PER_FILE = 8
SAMPLE_BYTES = 4096
_MAX_HEADER = 100 << 20

_cache: dict[tuple, str] = {}
_cache_lock = threading.Lock()


def weights_fingerprint(model: str | os.PathLike[str]) -> str | None:
    """Hex fingerprint of the weight files under ``model``; None if it is not a local folder.

    A hub id resolved by vLLM elsewhere gives None: its revision (already in
    the namespace) names the weights there.
    """
    root = Path(model)
    if not root.is_dir():
        return None
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    stats = tuple((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    key = (str(root.resolve()), stats)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    for path, (name, size, _) in zip(files, stats, strict=True):
        digest.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as fh:
            data_start = _safetensors_header(fh, digest) if path.suffix == ".safetensors" else 0
            for offset in _sample_offsets(data_start, size):
                fh.seek(offset)
                digest.update(fh.read(SAMPLE_BYTES))
    value = digest.hexdigest()[:32]
    with _cache_lock:
        _cache[key] = value
    return value


def _safetensors_header(fh, digest) -> int:
    """Hash the JSON header; the offset where tensor bytes start (0 if not safetensors)."""
    raw = fh.read(8)
    if len(raw) != 8:
        return 0
    (length,) = struct.unpack("<Q", raw)
    if length > _MAX_HEADER:
        return 0
    digest.update(fh.read(length))
    return 8 + length


def _sample_offsets(start: int, size: int) -> list[int]:
    """``SAMPLES_PER_FILE`` window starts spread evenly over ``[start, size)``."""
    span = size - start
    if span <= 0:
        return []
    if span <= SAMPLES_PER_FILE * SAMPLE_BYTES:
        return list(range(start, size, SAMPLE_BYTES))
    step = (span - SAMPLE_BYTES) // (SAMPLES_PER_FILE - 1)
    return [start + i * step for i in range(SAMPLES_PER_FILE)]
