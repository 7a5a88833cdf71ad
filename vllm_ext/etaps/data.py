"""ShareGPT text as fixed-length token blocks: calibration/training and held-out splits.

Calibration and training read conversations from 0 on; held-out text starts at
conversation 12,000 (as in docs/etaps.md), so the two never overlap.
"""

from __future__ import annotations

import torch

from vllm_ext.datasets.sharegpt import iter_conversations

HELD_OUT_START = 12_000


def _assistant_texts(skip: int):
    for i, record in enumerate(iter_conversations()):
        if i < skip:
            continue
        for turn in record["conversations"]:
            if turn.get("from") == "gpt" and isinstance(turn.get("value"), str):
                text = turn["value"].strip()
                if text:
                    yield text


def token_blocks(tokenizer, n_blocks: int, block_len: int, *, held_out: bool) -> torch.Tensor:
    """``[n_blocks, block_len]`` token ids of concatenated assistant replies (EOS between)."""
    if n_blocks < 1 or block_len < 2:
        raise ValueError(f"need n_blocks >= 1 and block_len >= 2, got {n_blocks}, {block_len}")
    need = n_blocks * block_len
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for text in _assistant_texts(HELD_OUT_START if held_out else 0):
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(f"ShareGPT has only {len(ids)} tokens here, {need} needed")
    return torch.tensor(ids[:need], dtype=torch.long).view(n_blocks, block_len)
