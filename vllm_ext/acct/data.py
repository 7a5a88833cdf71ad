"""Long ShareGPT conversations as token windows for ACCT training and evaluation.

A conversation is rendered with the target's chat template (ChatML for
SmolLM2) and tokenized once. Conversations are split deterministically into
held-out (``eval``) and ``train`` by a hash of their id, so the quality gate
is never measured on text the converters were fitted to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from vllm_ext.datasets.sharegpt import iter_conversations

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Window:
    """``context`` tokens the cache holds, then ``continuation`` tokens the target decodes."""

    conversation_id: str
    context: np.ndarray
    continuation: np.ndarray


def split_of(conversation_id: str, eval_share: int = 10) -> str:
    """``"eval"`` for about one conversation in ``eval_share``, else ``"train"``."""
    digest = hashlib.sha256(conversation_id.encode()).digest()
    return "eval" if digest[0] % eval_share == 0 else "train"


def render(record: dict, tokenizer) -> list[int] | None:
    messages = []
    for turn in record["conversations"]:
        role = _ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        text = turn.get("value") if role else None
        if isinstance(text, str) and text.strip():
            messages.append({"role": role, "content": text})
    if len(messages) < 2:
        return None
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def long_conversations(
    tokenizer, min_tokens: int, split: str, limit: int, scan_limit: int = 20000
) -> Iterator[tuple[str, list[int]]]:
    """Up to ``limit`` conversations of ``split`` with at least ``min_tokens`` tokens."""
    found = 0
    for record in iter_conversations(scan_limit):
        cid = str(record.get("id", ""))
        if split_of(cid) != split:
            continue
        # a cheap character bound first: a token is at least one character
        if sum(len(t.get("value") or "") for t in record["conversations"]) < min_tokens:
            continue
        ids = render(record, tokenizer)
        if ids is None or len(ids) < min_tokens:
            continue
        yield cid, ids
        found += 1
        if found >= limit:
            return


def eval_windows(tokenizer, context: int, continuation: int, count: int) -> list[Window]:
    """The first ``context + continuation`` tokens of ``count`` held-out conversations."""
    total = context + continuation
    return [
        Window(cid, np.array(ids[:context]), np.array(ids[context:total]))
        for cid, ids in long_conversations(tokenizer, total, "eval", count)
    ]


def train_windows(
    tokenizer, context: int, continuation: int, conversations: int, seed: int
) -> Iterator[Window]:
    """An endless stream of random windows from ``conversations`` training conversations."""
    total = context + continuation
    pool = list(long_conversations(tokenizer, total, "train", conversations))
    if not pool:
        raise ValueError(f"no training conversation has {total} tokens")
    rng = np.random.default_rng(seed)
    while True:
        cid, ids = pool[int(rng.integers(len(pool)))]
        start = int(rng.integers(len(ids) - total + 1))
        window = np.array(ids[start : start + total])
        yield Window(cid, window[:context], window[context:])
