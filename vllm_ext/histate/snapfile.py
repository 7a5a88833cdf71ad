"""Crash-consistent snapshot files on the SSD tier (bytes in, bytes out; no vLLM).

File layout (little endian), one snapshot per file ``<sha256(key)[:40]>.snap``
in ``<directory>/ns-<namespace id>/``::

    magic    8s   b"HISTSNAP"
    version  u16  FORMAT_VERSION
    ns_len   u16  length of the namespace text
    key_len  u32  length of the key text
    length   u64  payload bytes
    crc      u32  zlib.crc32 of the payload
    hcrc     u32  zlib.crc32 of everything above + namespace + key
    namespace, key (UTF-8), payload

Why each part: the namespace (model, dtype, layer layout, block size,
parallelism, see :func:`namespace_id`) makes a state written by another model
or layout a miss, never a wrong hit; the length catches truncation; the two
CRCs catch torn or flipped bytes (vLLM's FS tier has no checksum, so a
renamed-but-unflushed file reads as garbage; reliability.md 7.1).

Who may read and write the folder (:mod:`vllm_ext.histate.folder_safety`): folders
are created ``0700`` and files ``0600`` (``0750``/``0640`` for a group-shared cache),
and a folder tree someone else could have written (a planted file would pass every
check below) is refused before any header is read.

Writes go to ``<name>.<writer>.<random>.tmp`` (``O_EXCL``), are fsynced,
atomically renamed and the folder fsynced, so a file under its final name is
always complete. Each store is one writer: it holds an exclusive ``flock`` on
``writers/<writer>.lock`` while it lives (the kernel drops it when the process
dies, kill -9 included), so a second engine on the same folder removes only
the temp files of writers whose lock is free and never another live writer's
in-flight files. A free lock file is unlinked while the checker holds it, and
a new store checks after locking that its lock file is still the one on disk
(else it takes another writer id), so a store caught between creating and
locking its file is never taken for a dead one. Every failure path (disk
full, EIO, read-only) returns False/None and counts; nothing raises into
serving. Files failing validation are moved to ``quarantine/`` and counted.
At start, leftover temp files are removed and the index is rebuilt by reading
every header, so a restart finds the entries again. Methods are safe to call
from several threads.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import os
import secrets
import struct
import threading
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from vllm_ext.common.counters import Counters
from vllm_ext.common.log import get_logger
from vllm_ext.histate.counters import new_counters
from vllm_ext.histate.folder_safety import PRIVATE, FolderPolicy, check_folder, make_folder
from vllm_ext.histate.namespaces import namespace_of, superseded

logger = get_logger(__name__)

MAGIC = b"HISTSNAP"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHHIQII")
SUFFIX, TMP_SUFFIX, QUARANTINE, WRITERS = ".snap", ".tmp", "quarantine", "writers"


class CorruptSnapshot(ValueError):
    """A snapshot file failed validation (reason in the message)."""


def namespace_id(**fields: Any) -> str:
    """Stable id of a layout: sha256 of the sorted JSON of ``fields`` (first 16 hex).

    Pass everything that changes the bytes of a state: model and revision,
    dtype, layer layout, block size, tensor/pipeline ranks, format version.
    """
    text = json.dumps({**fields, "format": FORMAT_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode(namespace: str, key: str, payload: bytes) -> bytes:
    """The full file content for ``payload`` under ``key``."""
    ns, k = namespace.encode(), key.encode()
    crc = zlib.crc32(payload)
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, len(ns), len(k), len(payload), crc, 0)[:-4]
    hcrc = zlib.crc32(head + ns + k)
    return head + struct.pack("<I", hcrc) + ns + k + payload


def read_header(fh: io.BufferedReader, namespace: str) -> tuple[str, int, int]:
    """Validate the header at the start of ``fh``; ``(key, payload length, payload crc)``."""
    raw = fh.read(_HEADER.size)
    if len(raw) != _HEADER.size:
        raise CorruptSnapshot("truncated header")
    magic, version, ns_len, key_len, length, crc, hcrc = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise CorruptSnapshot("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptSnapshot(f"format version {version}, expected {FORMAT_VERSION}")
    if ns_len > 4096 or key_len > 1 << 16:
        raise CorruptSnapshot("header lengths out of range")
    names = fh.read(ns_len + key_len)
    if len(names) != ns_len + key_len or zlib.crc32(raw[:-4] + names) != hcrc:
        raise CorruptSnapshot("header checksum mismatch")
    if names[:ns_len].decode(errors="replace") != namespace:
        raise CorruptSnapshot("foreign namespace")
    return names[ns_len:].decode(), length, crc


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Serialise named numpy arrays (no pickle) into one payload."""
    buf = io.BytesIO()
    np.savez(buf, **{name: np.ascontiguousarray(a) for name, a in arrays.items()})
    return buf.getvalue()


def unpack_arrays(payload: bytes) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_arrays`."""
    with np.load(io.BytesIO(payload), allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def file_name(key: str) -> str:
    """Name of ``key``'s file in its namespace folder."""
    return hashlib.sha256(key.encode()).hexdigest()[:40] + SUFFIX


def namespace_folder(directory: str | os.PathLike[str], namespace: str) -> Path:
    """The folder holding ``namespace``'s files under ``directory``."""
    return Path(directory) / f"ns-{namespace_id(namespace=namespace)}"


def scan(
    directory: str | os.PathLike[str], namespace: str, *, access: FolderPolicy = PRIVATE
) -> dict[str, int]:
    """Key -> payload bytes of the valid-looking files, read-only (headers only).

    For a reader that does not own the files (the connector's scheduler half):
    nothing is moved or deleted; the owning :class:`SnapshotStore` quarantines.
    An unsafe folder is refused first (:func:`~vllm_ext.histate.folder_safety.check_folder`).
    """
    check_folder(directory, access)
    return _read_headers(namespace_folder(directory, namespace), namespace)[0]


def _read_headers(root: Path, namespace: str) -> tuple[dict[str, int], list[tuple[Path, str]]]:
    """(key -> payload bytes, [(bad file, why)]) of the files in ``root``."""
    index: dict[str, int] = {}
    bad: list[tuple[Path, str]] = []
    for path in sorted(root.glob("*" + SUFFIX)):
        try:
            with open(path, "rb") as fh:
                key, length, _ = read_header(fh, namespace)
            size = path.stat().st_size
        except CorruptSnapshot as exc:
            bad.append((path, str(exc)))
            continue
        except OSError as exc:
            logger.warning("HiState: skipping unreadable snapshot %s: %s", path, exc)
            continue
        if path.name != file_name(key) or size < length:
            bad.append((path, "misnamed or truncated file"))
            continue
        index[key] = length
    return index, bad


class SnapshotStore:
    """Snapshot files of one namespace under ``directory``.

    Args:
        directory: root folder (created if missing).
        namespace: layout text stored in every header; its :func:`namespace_id`
            names the sub-folder.
        fsync: make every write durable before it counts. Default: True.
        counters: where failures and I/O are counted. Default: a fresh set.
        access: modes to create with, owners and modes to accept. Default: private (0700/0600).
    """

    def __init__(
        self, directory: str | os.PathLike[str], namespace: str, *, fsync: bool = True,
        counters: Counters | None = None, access: FolderPolicy = PRIVATE,
    ):  # fmt: skip
        self.namespace = namespace
        self.access = access
        self.root = namespace_folder(directory, namespace)
        self.quarantine_dir = Path(directory) / QUARANTINE
        self.fsync = fsync
        self.counters = counters or new_counters()
        self._lock = threading.Lock()
        # key -> payload bytes of files known to be complete under their final name
        self._index: dict[str, int] = {}
        try:
            make_folder(Path(directory), access)
            # before anything in it is read: a folder others could write may hold planted files
            check_folder(directory, access)
            make_folder(self.root, access)
        except OSError as exc:
            # a bad folder is a configuration error: refuse at start, not per request
            raise ValueError(f"HiState SSD directory {directory!s} is not usable: {exc}") from exc
        self.writer = secrets.token_hex(6)
        self._writer_lock = self._hold_writer_lock()
        self._remove_stale_temps()
        self._sweep_other_namespaces()
        self.rebuild_index()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[str]:
        """Keys with a complete file."""
        with self._lock:
            return list(self._index)

    def sizes(self) -> dict[str, int]:
        """Key -> payload bytes."""
        with self._lock:
            return dict(self._index)

    def path(self, key: str) -> Path:
        """File of ``key`` (whether or not it exists)."""
        return self.root / file_name(key)

    def put(self, key: str, payload: bytes) -> bool:
        """Store ``payload`` durably under ``key``; False (counted) on any OS error."""
        return self.write(key, payload) == 0

    def write(self, key: str, payload: bytes) -> int:
        """:meth:`put`, returning 0 or the errno that failed it (``ENOSPC``: disk full)."""
        data = encode(self.namespace, key, bytes(payload))
        final = self.path(key)
        tmp = final.with_name(f"{final.stem}.{self.writer}.{secrets.token_hex(4)}{TMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, self.access.file_mode)
        except OSError as exc:
            return self._write_failed(key, tmp, exc, created=False)
        try:
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    if written <= 0:
                        raise OSError(errno.EIO, "short write")
                    view = view[written:]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            if self.fsync:
                self._fsync_dir()
        except OSError as exc:
            return self._write_failed(key, tmp, exc, created=True)
        with self._lock:
            self._index[key] = len(payload)
        self.counters.inc("ssd_writes")
        self.counters.inc("ssd_write_bytes", len(payload))
        return 0

    def get(self, key: str) -> bytes | None:
        """The verified payload of ``key``, or None (a miss) if absent, corrupt or unreadable."""
        if key not in self:
            return None
        path = self.path(key)
        try:
            with open(path, "rb") as fh:
                stored_key, length, crc = read_header(fh, self.namespace)
                payload = fh.read(length + 1)
        except FileNotFoundError:
            # deleted by a concurrent evict: a plain miss
            self._forget(key)
            return None
        except CorruptSnapshot as exc:
            self._quarantine(path, key, str(exc))
            return None
        except OSError as exc:
            self.counters.inc("ssd_read_failures")
            logger.warning("HiState: reading snapshot %s failed: %s", path, exc)
            return None
        problem = None
        if stored_key != key:
            problem = "key mismatch"
        elif len(payload) != length:
            problem = "payload length mismatch (torn file)"
        elif zlib.crc32(payload) != crc:
            problem = "payload checksum mismatch"
        if problem:
            self._quarantine(path, key, problem)
            return None
        self.counters.inc("ssd_reads")
        self.counters.inc("ssd_read_bytes", length)
        return payload

    def delete(self, key: str) -> bool:
        """Remove ``key``'s file; False if it was not there."""
        known = self._forget(key)
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            return known
        except OSError as exc:
            logger.warning("HiState: removing snapshot of %s failed: %s", key, exc)
        return True

    def rebuild_index(self) -> dict[str, int]:
        """Re-read every header; quarantine bad files; key -> payload bytes."""
        index, bad = _read_headers(self.root, self.namespace)
        for path, reason in bad:
            self._quarantine(path, None, reason)
        with self._lock:
            self._index = index
        logger.info("HiState: %d snapshots found in %s", len(index), self.root)
        return dict(index)

    def _write_failed(self, key: str, tmp: Path, exc: OSError, created: bool) -> int:
        self.counters.inc("ssd_write_failures")
        logger.warning("HiState: storing snapshot %s failed (%s); not stored", key, exc)
        if created:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return exc.errno or errno.EIO

    def _fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _forget(self, key: str) -> bool:
        with self._lock:
            return self._index.pop(key, None) is not None

    def _quarantine(self, path: Path, key: str | None, reason: str) -> None:
        self.counters.inc("ssd_corrupt")
        if key is not None:
            self._forget(key)
        logger.warning("HiState: snapshot file %s is invalid (%s); quarantined", path, reason)
        try:
            make_folder(self.quarantine_dir, self.access)
            os.replace(path, self.quarantine_dir / f"{path.name}.{secrets.token_hex(4)}")
        except OSError:
            # cannot move it: delete it, so it is never read again
            try:
                os.unlink(path)
            except OSError:
                pass

    def close(self) -> None:
        """Release this writer's lock (its temp files become removable by the next store)."""
        if self._writer_lock is not None:
            # unlink while still holding it: a lock file on disk is always a live one's or reapable
            try:
                os.unlink(self._lock_path(self.writer))
            except OSError:
                pass
            os.close(self._writer_lock)
            self._writer_lock = None

    def _lock_path(self, writer: str) -> Path:
        return self.quarantine_dir.parent / WRITERS / f"{writer}.lock"

    def _hold_writer_lock(self) -> int:
        """Create and lock this store's lock file; its name is ``self.writer``'s.

        Creating the file and locking it are two steps: a store starting in
        between finds the lock free and reaps the file (:meth:`_writer_alive`
        unlinks a free lock while it holds it). So: wait for the lock (a
        checker holds it only for an instant; never ``BlockingIOError``), then
        check the name still leads to the file we locked; if it was reaped,
        start again under a new writer id, whose temp files nobody can take for
        a dead writer's.
        """
        while True:
            path = self._lock_path(self.writer)
            make_folder(path.parent, self.access)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, self.access.file_mode)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    self._name_namespace(fd)
                    return fd
            except FileNotFoundError:
                pass  # reaped in the gap: the name is gone for good
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            self.writer = secrets.token_hex(6)

    def _name_namespace(self, fd: int) -> None:
        """Write our namespace folder into the lock file (best effort: a full disk may refuse;
        an empty lock file means "could be any namespace" to :meth:`_namespaces_in_use`)."""
        try:
            os.write(fd, self.root.name.encode())
        except OSError:
            pass

    def _writer_alive(self, writer: str) -> bool:
        """Does a live store hold ``writer``'s lock? A free lock is reaped.

        The file is unlinked while we hold its lock, so a store that created it
        but has not locked it yet finds its name gone once it does, and takes
        another (:meth:`_hold_writer_lock`): ``writer`` can never come alive
        after this answered False. A missing lock file: not alive.
        """
        path = self._lock_path(writer)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # cannot tell: keep its files
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return True
        try:
            path.unlink()
        except OSError:
            pass
        finally:
            os.close(fd)
        return False

    def _remove_stale_temps(self) -> None:
        """Remove the temp files of dead writers (and their lock files); live ones' stay."""
        alive: dict[str, bool] = {self.writer: True}
        for tmp in self.root.glob("*" + TMP_SUFFIX):
            parts = tmp.name.split(".")
            # <name>.<writer>.<random>.tmp; older files carry no writer: never live
            writer = parts[1] if len(parts) == 4 else ""
            if writer and writer not in alive:
                alive[writer] = self._writer_alive(writer)
            if writer and alive[writer]:
                continue
            try:
                tmp.unlink()
                self.counters.inc("ssd_stale_temp_removed")
            except OSError as exc:
                logger.warning("HiState: cannot remove stale temp file %s: %s", tmp, exc)
        for lock in self._lock_path(self.writer).parent.glob("*.lock"):
            if lock.stem not in alive:
                self._writer_alive(lock.stem)  # reaps the lock files of dead writers

    def _sweep_other_namespaces(self) -> None:
        """Count other namespaces' files; remove those of superseded ones no live store uses.

        Another namespace's files are never read (other model, layout or
        weights). A superseded one's (:func:`~vllm_ext.histate.namespaces.superseded`:
        the same model and layout with other weights) can never be a hit again.
        """
        in_use = self._namespaces_in_use()
        foreign = 0
        for folder in sorted(self.root.parent.glob("ns-*")):
            files = list(folder.glob("*" + SUFFIX)) if folder != self.root else []
            if not files:
                continue
            other = namespace_of(folder, MAGIC, SUFFIX)
            if other is None or not superseded(self.namespace, other) or (
                folder.name in in_use or None in in_use
            ):
                foreign += len(files)
                continue
            removed = 0
            for path in [*files, *folder.glob("*" + TMP_SUFFIX)]:
                try:
                    path.unlink()
                    removed += path.suffix == SUFFIX
                except OSError:
                    pass
            try:
                folder.rmdir()
            except OSError:
                pass
            self.counters.inc("ssd_superseded_removed", removed)
            logger.info(
                "HiState: removed %d snapshot files of %s: the same model and layout with other "
                "(or unverified) weights, never a hit again", removed, folder.name,
            )  # fmt: skip
        if foreign:
            self.counters.inc("ssd_foreign_files", foreign)
            logger.info(
                "HiState: %d snapshot files of other models, layouts or weights under %s are "
                "never read", foreign, self.root.parent,
            )  # fmt: skip

    def _namespaces_in_use(self) -> set[str | None]:
        """Folders of the live stores of other writers (None: a live one that has not said)."""
        used: set[str | None] = set()
        for lock in self._lock_path(self.writer).parent.glob("*.lock"):
            if lock.stem == self.writer or not self._writer_alive(lock.stem):
                continue
            try:
                used.add(lock.read_text() or None)
            except (OSError, UnicodeDecodeError):
                used.add(None)
        return used
