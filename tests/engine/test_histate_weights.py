"""Snapshots written for other weights at the same model path are never loaded.

Engine 1 serves a prompt and leaves its recurrent-state snapshot on the SSD
tier; the weights are then replaced in place (same files, names, shapes and
dtypes: only the values differ, as when a fine-tune is written over its base)
and engine 2 starts on the same path and SSD folder. Before the weights
fingerprint joined the namespace, engine 2 loaded the old state next to KV
computed with the new weights and decoded wrong tokens.
"""

from __future__ import annotations

import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.engine.test_histate_engine import (
    BLOCK,
    MODEL,
    _params,
    _run,
    _tokens,
    histate_kwargs,
    scheduler_of,
)
from tests.helpers import engine
from vllm_ext.assets import model_path

SHARED = _tokens(1500, 2 * BLOCK)
R1 = SHARED + _tokens(1501, 800)  # fills the host tier with the shared KV
R2 = SHARED + _tokens(1502, 300)  # its snapshot at 768 tokens is the one at stake


def _perturb_in_place(folder) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    rng = np.random.default_rng(0)
    for name, t in tensors.items():
        if t.is_floating_point():
            noise = torch.from_numpy(rng.standard_normal(tuple(t.shape)).astype(np.float32))
            tensors[name] = (t.float() + 0.5 * t.float().std().nan_to_num(0.02) * noise).to(t.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_snapshots_of_replaced_weights_are_not_loaded_and_tokens_are_right(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(model_path(MODEL), folder)
    ssd = tmp_path / "ssd"
    kwargs = histate_kwargs(directory=str(ssd), host_bytes=256 << 20)
    with engine(folder, **kwargs) as llm:
        conn = scheduler_of(llm).connector
        _run(llm, R2)
        conn.runtime.drain()
        conn.shutdown()  # host snapshots -> SSD
    del llm
    assert any(ssd.rglob("*.snap"))
    _perturb_in_place(folder)
    with engine(folder, **kwargs) as llm:
        conn = scheduler_of(llm).connector
        assert len(conn.runtime.tiers.ssd) == 0  # nothing adopted from the old weights
        # cold reference for the new weights: a cache salt changes every block hash
        salted = {"prompt_token_ids": R2, "cache_salt": "cold"}
        cold = list(llm.generate([salted], _params(), use_tqdm=False)[0].outputs[0].token_ids)
        _run(llm, R1, 2)
        conn.runtime.drain()
        llm.reset_prefix_cache()
        tokens = list(_run(llm, R2).outputs[0].token_ids)
        assert conn.counters.value("snapshots_loaded_ssd") == 0
        assert conn.counters.value("ssd_hits") == 0
        assert tokens == cold
        conn.shutdown()
    del llm
