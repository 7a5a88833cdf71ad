"""Snapshots written for other weights at the same model path are never loaded.

Second test (issue 36): engines restarted inside one process on the same SSD
folder, with the Gated-DeltaNet projections of both GDN layers scaled x1.25
in place between them (same file, same size, mtime restored as ``touch -r``
would): the restarted engine decodes a cold engine's tokens and loads no old
snapshot; the old namespace's files are removed, counted.

Engine 1 serves a prompt and leaves its recurrent-state snapshot on the SSD
tier; the weights are then replaced in place (same files, names, shapes and
dtypes: only the values differ, as when a fine-tune is written over its base)
and engine 2 starts on the same path and SSD folder. Before the weights
fingerprint joined the namespace, engine 2 loaded the old state next to KV
computed with the new weights and decoded wrong tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.engine.test_histate_engine import (
    BLOCK,
    ENGINE,
    MODEL,
    _params,
    _run,
    _tokens,
    counter,
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


LONG = [_tokens(3600 + i, 2 * BLOCK + 100 * i + 50) for i in range(3)]
GDN_PROJECTIONS = ("linear_attn.in_proj_qkvz.weight", "linear_attn.out_proj.weight")


def _scale_gdn_projections_in_place(folder, factor: float = 1.25) -> list[str]:
    """Scale the GDN projection weights in the file's own bytes; keep its size and mtime."""
    path = folder / "model.safetensors"
    before = os.stat(path)
    scaled = []
    with open(path, "r+b") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
        for name, info in sorted(header.items()):
            if not name.endswith(GDN_PROJECTIONS):
                continue
            assert info["dtype"] == "BF16", info
            begin, end = (8 + length + o for o in info["data_offsets"])
            fh.seek(begin)
            weights = torch.frombuffer(bytearray(fh.read(end - begin)), dtype=torch.bfloat16)
            fh.seek(begin)
            fh.write(bytes((weights.float() * factor).to(torch.bfloat16).view(torch.uint8)))
            scaled.append(name)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    return scaled


def _greedy(llm, prompt) -> list[int]:
    return list(_run(llm, prompt).outputs[0].token_ids)


def test_engine_restarted_in_process_after_weights_scaled_in_place_decodes_cold_tokens(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(model_path(MODEL), folder)
    ssd = tmp_path / "ssd"
    kwargs = histate_kwargs(directory=str(ssd), host_bytes=4 << 20)
    with engine(folder, **kwargs) as llm:
        conn = scheduler_of(llm).connector
        for prompt in LONG:
            _run(llm, prompt)
        conn.runtime.drain()
        conn.shutdown()  # host snapshots -> SSD
    del llm
    old_files = sorted(ssd.rglob("*.snap"))
    assert len(old_files) >= len(LONG)
    scaled = _scale_gdn_projections_in_place(folder)
    assert len(scaled) == 4  # two GDN layers, two projections each
    with engine(folder, **ENGINE) as llm:  # cold, new weights, no connector
        cold = [_greedy(llm, prompt) for prompt in LONG]
    del llm
    with engine(folder, **kwargs) as llm:  # same process, same folder
        conn = scheduler_of(llm).connector
        adopted = len(conn.runtime.tiers.ssd)
        first = [_greedy(llm, prompt) for prompt in LONG]
        first_hits = counter(llm, "hit_tokens")
        # the repeats hit what this engine stored: with the old namespace, old SSD states
        conn.runtime.drain()
        llm.reset_prefix_cache()
        again = [_greedy(llm, prompt) for prompt in LONG]
        assert first == cold and again == cold
        assert adopted == 0  # nothing adopted from the old weights
        assert counter(llm, "ssd_superseded_removed") == len(old_files)
        assert not any(f.exists() for f in old_files)
        assert first_hits == 0
        assert counter(llm, "hit_tokens") > 0  # the repeats were hits, of new states
        conn.shutdown()
    del llm
