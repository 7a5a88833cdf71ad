"""Reading ``vllm serve`` arguments before vLLM parses them (the plugin and the launcher
run first, so a refusal can name the problem before any engine work)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NoReturn


def flag_values(args: Sequence[str], names: tuple[str, ...]) -> list[str]:
    """Values given to any of ``names`` (``--name v``, ``--name=v``, ``_`` for ``-``; a bare
    flag gives ""), in order: the last one wins, as in argparse."""
    values = []
    for i, arg in enumerate(args):
        name, has_value, value = arg.partition("=")
        if name.replace("_", "-") not in names:
            continue
        if not has_value:
            following = args[i + 1] if i + 1 < len(args) else ""
            value = "" if following.startswith("-") else following
        values.append(value)
    return values


def int_or_one(value: str) -> int:
    """``value`` as an int; 1 (vLLM's default) when it is not one: vLLM's parser reports it."""
    try:
        return int(value)
    except ValueError:
        return 1


def exit_serve_error(problem: object) -> NoReturn:
    """Stop ``vllm serve`` with one line, as its own argparse errors do (exit status 2)."""
    sys.stderr.write(f"vllm serve: error: {problem}\n")
    sys.stderr.flush()
    raise SystemExit(2) from None
