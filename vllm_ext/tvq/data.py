"""ShareGPT token chunks: conversations 0–3k train, 12k on held out (as in the report)."""

from __future__ import annotations

import torch

from vllm_ext.datasets.sharegpt import iter_conversations

TRAIN_RANGE = (0, 3000)
HELD_OUT_START = 12000


def _texts(start: int, stop: int):
    for i, record in enumerate(iter_conversations(stop)):
        if i < start:
            continue
        for turn in record["conversations"]:
            if turn.get("from") == "gpt" and isinstance(turn.get("value"), str) and turn["value"]:
                yield turn["value"]


def token_chunks(tokenizer, n_chunks: int, seq_len: int, held_out: bool) -> torch.Tensor:
    """``[n_chunks, seq_len]`` token ids of concatenated assistant replies."""
    start, stop = (HELD_OUT_START, HELD_OUT_START + 3000) if held_out else TRAIN_RANGE
    need = n_chunks * seq_len
    ids: list[int] = []
    for text in _texts(start, stop):
        ids.extend(tokenizer(text + tokenizer.eos_token)["input_ids"])
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(f"ShareGPT range {start}-{stop} has only {len(ids)} tokens, need {need}")
    return torch.tensor(ids[:need]).reshape(n_chunks, seq_len)
