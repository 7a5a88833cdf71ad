"""Who may read and write HiState's SSD folder: modes at creation, refusal at start (no vLLM).

Snapshot files hold recurrent state and KV derived from users' prompts (invertible toward
the text), and their checksums detect damage, not forgery: whoever can write the folder can
plant a well-formed file under a key a future prompt will hit. So:

- we create folders ``0700`` and files ``0600`` (``shared_group``: ``0750`` / ``0640``, for
  a cache shared by the members of one group);
- at start, before any header is read, :func:`check_folder` refuses (one line) a folder
  tree that someone else could have written: a folder or file owned by another user
  (``shared_group``: by someone outside the folder's group that we are in), or writable by
  the world or (without ``shared_group``) by its group, or a parent folder others may write
  without the sticky bit (they could swap our folder). ``allow_unsafe_directory`` turns the
  refusal into a warning;
- folders and files we own that are more open than the modes above (an older vllm_ext
  wrote ``0755`` / ``0644``) are tightened, so prompts' states stop being readable.

Called by the scheduler's read-only :func:`~vllm_ext.histate.snapfile.scan`, by
:class:`~vllm_ext.histate.snapfile.SnapshotStore` (the worker) and by ``vllm-ext serve``
before vLLM starts (:func:`folder_refusal`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_ext.common.config import ConfigError
from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

SUBFOLDERS = ("ns-*", "quarantine", "writers")


@dataclass(frozen=True)
class FolderPolicy:
    """Modes we create and owners and modes we accept.

    Args:
        shared_group: the folder is shared by one group's members. Default: False.
        allow_unsafe: log a warning instead of refusing an unsafe folder. Default: False.
    """

    shared_group: bool = False
    allow_unsafe: bool = False

    @property
    def dir_mode(self) -> int:
        return 0o750 if self.shared_group else 0o700

    @property
    def file_mode(self) -> int:
        return 0o640 if self.shared_group else 0o600

    @classmethod
    def of(cls, config: Any) -> FolderPolicy:
        """The policy of a ``HiStateConfig``."""
        return cls(config.shared_group, config.allow_unsafe_directory)


# the default: one user's private cache
PRIVATE = FolderPolicy()


def make_folder(path: Path, policy: FolderPolicy) -> None:
    """``mkdir -p`` with the policy's mode on every folder it creates (umask may only narrow)."""
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=policy.dir_mode)
        except FileExistsError:
            pass


def check_folder(directory: str | os.PathLike[str], policy: FolderPolicy) -> None:
    """Refuse (or, overridden, warn about) an SSD folder someone else could have written.

    Tightens the modes of what we own on the way. A missing folder is fine (nothing to trust
    yet; it is created with the policy's mode).

    Raises:
        ConfigError: one line naming the first problem and the setting that overrides it.
    """
    root = Path(directory)
    if not root.exists():
        return
    narrowed: list[Path] = []
    problem = _first_problem(root, policy, narrowed)
    if narrowed:
        logger.info(
            "HiState: narrowed the modes of %d entries under %s to %04o/%04o (e.g. %s): other "
            "users could read prompts' states", len(narrowed), root, policy.dir_mode,
            policy.file_mode, narrowed[0],
        )  # fmt: skip
    if problem is None:
        return
    if not policy.allow_unsafe:
        raise ConfigError(
            f"HiState SSD directory {root} is unsafe: {problem}; anyone who can write it can "
            "plant snapshots this server would serve (fix the owner/mode, use a private folder, "
            "or set histate.allow_unsafe_directory=true to accept the risk)"
        )
    logger.warning(
        "HiState: SSD directory %s is UNSAFE (%s) and allow_unsafe_directory is set: anyone "
        "who can write it can plant snapshots this server will serve", root, problem,
    )  # fmt: skip


def ensure_safe_folder(config: Any) -> None:
    """:func:`check_folder` of a ``HiStateConfig``'s SSD folder, if it has an SSD tier.

    The connector calls it first thing, before the namespace is derived (that reads
    ``weights-fingerprints.json`` from the folder) and before any snapshot header is read.
    """
    if config.directory is not None and config.ssd_bytes > 0:
        check_folder(config.directory, FolderPolicy.of(config))


def folder_refusal(config: Any) -> str | None:
    """:func:`check_folder` of a ``HiStateConfig`` as a message (None: safe or no SSD tier)."""
    try:
        ensure_safe_folder(config)
    except ConfigError as exc:
        return str(exc)
    return None


def _first_problem(root: Path, policy: FolderPolicy, narrowed: list[Path]) -> str | None:
    """The first reason not to trust ``root``; narrows what we own on the way (``narrowed``)."""
    for parent in root.resolve().parents:
        problem = _parent_problem(parent, policy)
        if problem:
            return problem
    problem = _entry_problem(root, os.stat(root), policy, "folder")
    if problem:
        return problem
    _tighten(root, os.stat(root), policy.dir_mode, narrowed)
    # the root's own files too: weights-fingerprints.json decides which namespace is ours
    problem = _files_problem(root, policy, narrowed)
    if problem:
        return problem
    for pattern in SUBFOLDERS:
        for sub in sorted(root.glob(pattern)):
            info = os.lstat(sub)
            if not stat.S_ISDIR(info.st_mode):
                return f"{sub} is not a folder (a link or a file put there)"
            problem = _entry_problem(sub, info, policy, "folder") or _files_problem(
                sub, policy, narrowed
            )
            if problem:
                return problem
            _tighten(sub, info, policy.dir_mode, narrowed)
    return None


def _files_problem(folder: Path, policy: FolderPolicy, narrowed: list[Path]) -> str | None:
    for path in folder.iterdir():
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue  # removed by a live writer meanwhile
        if stat.S_ISLNK(info.st_mode):
            return f"{path} is a link, which HiState never makes (someone else put it there)"
        kind = "folder" if stat.S_ISDIR(info.st_mode) else "file"
        problem = _entry_problem(path, info, policy, kind)
        if problem:
            return problem
        if stat.S_ISREG(info.st_mode):
            _tighten(path, info, policy.file_mode, narrowed)
    return None


def _entry_problem(path: Path, info: os.stat_result, policy: FolderPolicy, kind: str) -> str | None:
    if not _trusted_owner(info, policy):
        return f"{kind} {path} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & stat.S_IWOTH:
        return f"{kind} {path} is writable by every user (mode {_mode(info)})"
    if info.st_mode & stat.S_IWGRP and not policy.shared_group:
        return (
            f"{kind} {path} is writable by its group (mode {_mode(info)}; "
            "set histate.shared_group=true for a group-shared cache)"
        )
    return None


def _parent_problem(parent: Path, policy: FolderPolicy) -> str | None:
    info = os.stat(parent)
    # a sticky folder (/tmp) lets others create entries but not rename or remove ours
    if info.st_mode & stat.S_ISVTX:
        return None
    open_bits = stat.S_IWOTH | (0 if policy.shared_group else stat.S_IWGRP)
    if info.st_mode & open_bits:
        return f"its parent {parent} is writable by others (mode {_mode(info)}, not sticky)"
    return None


def _trusted_owner(info: os.stat_result, policy: FolderPolicy) -> bool:
    if info.st_uid == os.geteuid():
        return True
    # a group-shared cache: any member of the entry's group, if we are in that group too
    return policy.shared_group and info.st_gid in {os.getegid(), *os.getgroups()}


def _tighten(path: Path, info: os.stat_result, mode: int, narrowed: list[Path]) -> None:
    """Drop the permission bits of ``path`` beyond ``mode`` (only what we own)."""
    extra = stat.S_IMODE(info.st_mode) & ~mode & 0o777
    if not extra or info.st_uid != os.geteuid():
        return
    try:
        os.chmod(path, stat.S_IMODE(info.st_mode) & ~extra)
    except OSError as exc:
        logger.warning("HiState: cannot narrow the mode of %s: %s", path, exc)
        return
    narrowed.append(path)


def _mode(info: os.stat_result) -> str:
    return f"{stat.S_IMODE(info.st_mode):04o}"
