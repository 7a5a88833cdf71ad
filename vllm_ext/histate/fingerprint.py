"""A fingerprint of a checkpoint's weights that changes when any weight byte does (no vLLM).

The snapshot namespace's model path and revision stay the same when the
weights at that path are replaced in place (a re-export, a fine-tune written
over its base, a few tensors scaled): snapshots written for the old weights
would load into the new model and decode wrong tokens. So the namespace holds
a SHA-256 of every byte of every weight file: a sampled hash (header, size
and a few windows) missed tensors lying between its windows (issue 36).

Cost: each weight file is read once, in 256 MiB segments hashed in parallel
threads (hashlib releases the GIL), so a single-file checkpoint uses every
core too; the file digest is SHA-256 over its segments' digests. Measured
~0.45 GB/s per core from the page cache on a shared 2-core VM
(docs/histate.md): a 70B bf16 checkpoint (~140 GB) on 16 cores costs about
one extra read of it from the SSD; disk bandwidth, not hashing, bounds it.

That cost is paid once per weight change, not per start: digests are cached
in-process and in ``weights-fingerprints.json`` in the SSD folder, keyed by
each file's (resolved path, size, mtime_ns, ctime_ns, inode, device). An
in-place write or ``os.utime``/``touch -r`` changes ctime, which user space
cannot set back, so a cached digest is reused only when no byte can have
changed. File times come from a coarse clock (one kernel tick), so a file
written in the same tick as a hash began could change with no visible ctime
change: as git does with "racily clean" index entries, a digest is cached only
if the file's ctime and mtime are at least ``RACY_NS`` older than the moment
hashing began; otherwise the next start hashes the file again. A file that
changes while it is hashed is hashed again.

Why not hash as the loader streams the tensors it reads anyway: it needs a hook
in every vLLM loader (safetensors, GGUF, sharded state, streamers) and the
namespace is needed on the scheduler side, which never loads weights; with the
cache, a restart on unchanged weights reads nothing.

A fingerprint that cannot be trusted -- a local folder with no weight files,
an unreadable file, a hub id not found in the local hub cache -- is
``unverified-<random>``: a namespace no file on disk has, so every lookup is a
miss and nothing is ever a wrong hit.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CACHE_FILE = "weights-fingerprints.json"
SEGMENT_BYTES = 256 << 20
READ_BYTES = 8 << 20
# a file whose times are this close to the start of its hash is re-hashed next time (above)
RACY_NS = 2_000_000_000
UNVERIFIED = "unverified-"
_CACHE_VERSION = 1

# resolved path -> (stat key, hex digest): trusted digests of this process
_cache: dict[str, tuple[tuple[int, ...], str]] = {}
_cache_lock = threading.Lock()
# one hash at a time in a process: the scheduler and worker halves ask for the same files
_hash_lock = threading.Lock()


def weights_fingerprint(
    model: str | os.PathLike[str], *, revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    hub_cache_dir: str | os.PathLike[str] | None = None,
) -> str:  # fmt: skip
    """Hex fingerprint of every byte of the weight files of ``model``.

    Args:
        model: a local folder, or a hub id looked up in the local hub cache.
        revision: the hub revision of a hub id.
        cache_dir: folder of the persistent digest cache (the SSD tier's
            folder); None = this process's cache only.
        hub_cache_dir: the hub cache vLLM downloads into (``--download-dir``).

    Returns:
        32 hex digits, or ``unverified-<random>`` (a miss for every lookup)
        when the weights cannot be read.
    """
    root = _local_folder(model, revision, hub_cache_dir)
    if root is None:
        return _unverified("%s is not a local folder nor in the local hub cache", model)
    files = sorted(p for p in root.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        return _unverified("no weight files (%s) under %s", "/".join(WEIGHT_SUFFIXES), root)
    try:
        digests = file_digests(files, cache_dir)
    except OSError as exc:
        return _unverified("reading the weights under %s failed: %s", root, exc)
    except _Unstable as exc:
        return _unverified("weight file %s changed while it was hashed", exc)
    total = hashlib.sha256()
    for path in files:
        total.update(f"{path.relative_to(root)}\0{digests[path]}\0".encode())
    return total.hexdigest()[:32]


class _Unstable(Exception):
    """A file kept changing while it was hashed."""


def file_digests(
    files: list[Path], cache_dir: str | os.PathLike[str] | None = None
) -> dict[Path, str]:
    """Path -> SHA-256 hex of its content, from the caches where no byte can have changed."""
    with _hash_lock:
        store = _PersistentCache(cache_dir)
        out: dict[Path, str] = {}
        todo: list[tuple[Path, tuple[int, ...]]] = []
        for path in files:
            resolved, key = str(path.resolve()), stat_key(path)
            with _cache_lock:
                hit = _cache.get(resolved)
            digest = hit[1] if hit is not None and hit[0] == key else store.get(resolved, key)
            if digest is None:
                todo.append((path, key))
            else:
                out[path] = digest
        if todo:
            started = time.monotonic()
            hashed = _hash_files(todo)
            size = sum(key[0] for _, key in todo)
            logger.info(
                "HiState: hashed %d weight file(s), %.1f MB, in %.2f s (%d reused from cache)",
                len(todo), size / 1e6, time.monotonic() - started, len(out),
            )  # fmt: skip
            for path, (digest, key, cacheable) in hashed.items():
                out[path] = digest
                if cacheable:
                    with _cache_lock:
                        _cache[str(path.resolve())] = (key, digest)
                    store.put(str(path.resolve()), key, digest)
            store.save()
        return out


def stat_key(path: Path) -> tuple[int, ...]:
    """What changes whenever a byte of ``path`` may have: size, mtime, ctime, inode, device."""
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _hash_files(todo: list[tuple[Path, tuple[int, ...]]]) -> dict[Path, tuple]:
    """Path -> (digest, stat key it is valid for, cacheable), segments hashed in parallel."""
    out: dict[Path, tuple] = {}
    for _attempt in range(3):
        begun = time.time_ns()
        jobs = [(path, at) for path, key in todo for at in range(0, key[0] or 1, SEGMENT_BYTES)]
        workers = max(1, min(len(jobs), os.cpu_count() or 1, 16))
        with ThreadPoolExecutor(workers, thread_name_prefix="histate-hash") as pool:
            parts = list(pool.map(lambda job: _hash_segment(*job), jobs))
        segments: dict[Path, list[bytes]] = {}
        for (path, _), part in zip(jobs, parts, strict=True):
            segments.setdefault(path, []).append(part)
        changed = []
        for path, key in todo:
            after = stat_key(path)
            if after != key:
                changed.append((path, after))  # written while hashed: hash it again
                continue
            digest = hashlib.sha256(b"".join(segments[path]))
            digest.update(key[0].to_bytes(8, "little"))
            # racily clean: times too close to the hash's start prove nothing (module doc)
            cacheable = max(key[1], key[2]) < begun - RACY_NS
            out[path] = (digest.hexdigest(), key, cacheable)
        if not changed:
            return out
        todo = changed
    raise _Unstable(todo[0][0])


def _hash_segment(path: Path, start: int) -> bytes:
    digest = hashlib.sha256()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    left = SEGMENT_BYTES
    with open(path, "rb", buffering=0) as fh:
        fh.seek(start)
        while left > 0:
            n = fh.readinto(view[: min(left, READ_BYTES)])
            if not n:
                break
            digest.update(view[:n])
            left -= n
    return digest.digest()


class _PersistentCache:
    """Digests kept in ``<cache_dir>/weights-fingerprints.json`` across processes.

    A damaged or foreign file is ignored (everything is hashed again); a file
    that cannot be written costs the next start a hash, nothing else.
    """

    def __init__(self, cache_dir: str | os.PathLike[str] | None):
        self.path = None if cache_dir is None else Path(cache_dir) / CACHE_FILE
        self.entries: dict[str, dict] = {}
        self.dirty = False
        if self.path is None:
            return
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") == _CACHE_VERSION and isinstance(data.get("files"), dict):
                self.entries = data["files"]
        except (OSError, ValueError, AttributeError):
            pass

    def get(self, resolved: str, key: tuple[int, ...]) -> str | None:
        entry = self.entries.get(resolved)
        if not isinstance(entry, dict) or entry.get("key") != list(key):
            return None
        digest = entry.get("sha256")
        return digest if isinstance(digest, str) and len(digest) == 64 else None

    def put(self, resolved: str, key: tuple[int, ...], digest: str) -> None:
        self.entries[resolved] = {"key": list(key), "sha256": digest}
        self.dirty = True

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        tmp = self.path.with_name(f"{CACHE_FILE}.{secrets.token_hex(4)}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"version": _CACHE_VERSION, "files": self.entries}))
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("HiState: cannot save weight digests to %s: %s", self.path, exc)
            tmp.unlink(missing_ok=True)


def _local_folder(model, revision: str | None, hub_cache_dir) -> Path | None:
    """The folder holding ``model``'s weights: itself, or its snapshot in the local hub cache."""
    root = Path(model)
    if root.is_dir():
        return root
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            str(model), revision=revision, cache_dir=hub_cache_dir, local_files_only=True
        )
    except Exception:  # noqa: BLE001 - any failure means: not found locally
        return None
    return Path(folder)


def _unverified(why: str, *args) -> str:
    logger.warning("HiState: weights fingerprint unavailable (" + why + "); SSD snapshots of "
                   "this run are never reused", *args)  # fmt: skip
    return UNVERIFIED + secrets.token_hex(8)


def clear_cache() -> None:
    """Forget this process's digests (tests: as a new process would start)."""
    with _cache_lock:
        _cache.clear()
