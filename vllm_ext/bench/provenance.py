"""What a result records about how it was made: the command line and each variant's config.

A result must be reproducible by someone else on another machine, so what it
records carries no absolute path and no host name (:func:`scrub`), and the
config of every variant is the *resolved* one: the system's config dataclass
built from the mapping the variant passed, defaults and environment included
(:func:`resolve_system_config`), not only the keys the benchmark happened to set.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_ext.common.config import load_config
from vllm_ext.common.systems import SYSTEM_CONFIGS, config_class

# an absolute path: a "/" not after a word, a dot, a colon or another "/" (URLs, "a/b")
_ABS_PATH = re.compile(r"(?<![\w.~<>:/-])/(?!/)[^\s:;,'\"()\[\]{}]*")


def _roots() -> list[tuple[str, str]]:
    """Known folders and the token each is replaced with, longest first."""
    candidates = {
        os.getcwd(): ".",
        tempfile.gettempdir(): "<tmp>",
        sys.prefix: "<python>",
        sys.base_prefix: "<python>",
        str(Path.home()): "~",
    }
    roots = [(os.path.normpath(p), t) for p, t in candidates.items() if p and p != "/"]
    return sorted(roots, key=lambda r: len(r[0]), reverse=True)


def _relative(path: str, roots: list[tuple[str, str]]) -> str:
    norm = os.path.normpath(path)
    for root, token in roots:
        if norm == root:
            return token
        if norm.startswith(root + os.sep):
            return f"{token}/{norm[len(root) + 1 :]}"
    return f"<path>/{os.path.basename(norm)}" if os.path.basename(norm) else "<path>"


def _host_pattern() -> re.Pattern[str] | None:
    try:
        host = socket.gethostname()
    except OSError:
        return None
    names = {host, host.split(".")[0]} - {""}
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"(?<![\w-])(?:{alternatives})(?![\w-])") if alternatives else None


def scrub(obj: Any) -> Any:
    """``obj`` with every absolute path made relative to a known folder and the host name gone.

    Paths under the current directory become ``./...``, under the temp folder
    ``<tmp>/...``, under Python's prefix ``<python>/...``, under the home folder
    ``~/...``; any other absolute path keeps only its last part (``<path>/name``).
    Whole-word occurrences of this machine's host name become ``<host>``.
    """
    roots, host = _roots(), _host_pattern()

    def one(value: Any) -> Any:
        if isinstance(value, str):
            text = _ABS_PATH.sub(lambda m: _relative(m.group(0), roots), value)
            return host.sub("<host>", text) if host else text
        if isinstance(value, Mapping):
            return {k: one(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [one(v) for v in value]
        return value

    return one(obj)


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """``python -m <module> <argv>`` as one shell-quoted line (``argv`` default: sys.argv[1:])."""
    args = list(sys.argv[1:] if argv is None else argv)
    return scrub(shlex.join(["python", "-m", module, *args]))


def current_command() -> str:
    """This process's command line, interpreter as ``python``, paths scrubbed."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    return scrub(shlex.join(["python", *argv[1:]]))


def resolve_system_config(
    system: str, mapping: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Every field of ``system``'s config as the system would see ``mapping`` (paths scrubbed)."""
    cfg = load_config(config_class(system), system, mapping or {}, environ)
    return scrub(dataclasses.asdict(cfg))


def resolve_additional_config(
    additional: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """``--additional-config``'s per-system blocks, each resolved; other keys are kept as given."""
    out: dict[str, dict[str, Any]] = {}
    for key, block in (additional or {}).items():
        if key not in SYSTEM_CONFIGS:
            out[key] = scrub(block)
            continue
        out[key] = resolve_system_config(key, block, environ)
    return out


def serve_config(
    launcher: str,
    serve_args: Sequence[str],
    env: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """What one served variant ran: launcher, ``serve`` arguments, env overrides and the
    resolved config of every system named in its ``--additional-config``.

    ``environ`` is the environment the server sees (default: this process's plus ``env``).
    """
    import json

    args = list(serve_args)
    additional: dict[str, Any] = {}
    if "--additional-config" in args:
        additional = json.loads(args[args.index("--additional-config") + 1])
    seen = {**os.environ, **(env or {})} if environ is None else environ
    return {
        "launcher": launcher,
        "serve_args": scrub(args),
        "env": scrub(dict(env or {})),
        "systems": resolve_additional_config(additional, seen),
        **scrub(extra),
    }
