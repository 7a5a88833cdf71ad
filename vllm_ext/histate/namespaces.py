"""Which other snapshot namespaces under the SSD folder can never be a hit again (no vLLM).

Each namespace has its own folder (:func:`~vllm_ext.histate.snapfile.namespace_folder`),
so an engine never reads another namespace's files. After a weights change,
the old namespace's folder would stay on disk for good: same model and
layout, other weights. Such a namespace is *superseded*; so is one whose
weights fingerprint was unverified (``unverified-<random>``: no later engine
can name it). The owning :class:`~vllm_ext.histate.snapfile.SnapshotStore`
removes a superseded folder's files at start when no live writer uses it, and
counts the rest as foreign.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

from vllm_ext.histate.fingerprint import UNVERIFIED

_PREFIX = struct.Struct("<8sHHIQI")  # the snapshot header up to its checksum


def namespace_of(folder: Path, magic: bytes, suffix: str) -> str | None:
    """The namespace text in the header of the first intact file of ``folder``."""
    for path in sorted(folder.glob("*" + suffix)):
        try:
            with open(path, "rb") as fh:
                raw = fh.read(_PREFIX.size + 4)
                if len(raw) != _PREFIX.size + 4:
                    continue
                head_magic, _, ns_len, key_len, _, _ = _PREFIX.unpack(raw[:-4])
                if head_magic != magic or ns_len > 4096 or key_len > 1 << 16:
                    continue
                names = fh.read(ns_len + key_len)
        except OSError:
            continue
        (hcrc,) = struct.unpack("<I", raw[-4:])
        if len(names) == ns_len + key_len and zlib.crc32(raw[:-4] + names) == hcrc:
            return names[:ns_len].decode(errors="replace")
    return None


def superseded(mine: str, other: str) -> bool:
    """Can ``other``'s files never be a hit again, given this engine runs ``mine``?

    True when ``other`` names unverified weights, or the same model and layout
    as ``mine`` with other weights. Namespaces that are not the JSON of
    :func:`~vllm_ext.histate.metadata.cache_namespace` are never superseded.
    """
    try:
        a, b = json.loads(mine), json.loads(other)
    except ValueError:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict) or "weights" not in b:
        return False
    if str(b["weights"]).startswith(UNVERIFIED):
        return True
    rest = lambda d: {k: v for k, v in d.items() if k != "weights"}  # noqa: E731
    return b["weights"] != a.get("weights") and rest(a) == rest(b)
