"""Authenticating ARK's KV frames and announcements with a shared secret (no vLLM).

Without this, anyone who can reach a decode instance's KV listener and learns or guesses a
transfer id can hand it a forged KV cache, and anyone who can send UDP to a prefill sender
can steer its planner. Peers are first checked by address (``kv_senders``, ``peers``); with
a secret configured, every frame and announcement also carries an HMAC-SHA256 tag over
everything it says, so a sender that is not one of ours cannot forge or alter one even from
an allowed address. The two kinds of message are tagged under different labels, so a tag of
one is never valid for the other.

The secret is read from a file (``ArkConfig.secret_file`` or ``VLLMEXT_ARK_SECRET_FILE``),
never passed on a command line, where every local user could read it in ``ps``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

from vllm_ext.common.config import ConfigError
from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

TAG_BYTES = 32  # SHA-256
MIN_SECRET_BYTES = 16
FRAME_LABEL = b"ark-kv-frame-v1\0"
ANNOUNCE_LABEL = b"ark-announcement-v1\0"


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped: a trailing newline is not key).

    Raises:
        ConfigError: unreadable, or shorter than :data:`MIN_SECRET_BYTES` bytes.
    """
    try:
        with open(path, "rb") as fh:
            secret = fh.read().strip()
            mode = os.fstat(fh.fileno()).st_mode
    except OSError as exc:
        raise ConfigError(f"ArkConfig.secret_file {str(path)!r} cannot be read: {exc}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"ArkConfig.secret_file {str(path)!r} holds {len(secret)} bytes; use at least "
            f"{MIN_SECRET_BYTES} random bytes (e.g. `openssl rand -hex 32 > FILE`)"
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "ARK: secret file %s is readable by other users (mode %04o): anyone who reads it can "
            "forge KV frames; chmod 600 it", path, stat.S_IMODE(mode),
        )  # fmt: skip
    return secret


def tag(secret: bytes, label: bytes, *parts: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of ``label`` followed by ``parts`` (hashed in place, never concatenated)."""
    mac = hmac.new(secret, label, hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def verify(secret: bytes, label: bytes, received: bytes, *parts: bytes | memoryview) -> bool:
    """Is ``received`` the tag of ``parts``? (constant-time comparison)"""
    return len(received) == TAG_BYTES and hmac.compare_digest(tag(secret, label, *parts), received)
