"""The weights fingerprint in HiState's snapshot namespace follows the weights, not the path."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_ext.histate import fingerprint
from vllm_ext.histate.fingerprint import weights_fingerprint


@pytest.fixture
def checkpoint(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {
        f"layer{i}.weight": torch.from_numpy(rng.standard_normal((64, 96)).astype(np.float32))
        for i in range(12)
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_a_copy_has_the_same_fingerprint_and_a_folder_without_weights_none(checkpoint, tmp_path):
    copy = tmp_path.parent / (tmp_path.name + "-copy")
    shutil.copytree(checkpoint, copy)
    assert weights_fingerprint(checkpoint) == weights_fingerprint(copy) is not None
    assert weights_fingerprint("org/hub-model-id") is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_changed_in_place_with_the_same_header_change_the_fingerprint(checkpoint, seed):
    before = weights_fingerprint(checkpoint)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    # same names, shapes and dtypes (so the same header and size): only values differ,
    # as when a fine-tune is written over the checkpoint it started from
    rng = np.random.default_rng(seed)
    for name in tensors:
        tensors[name] = tensors[name] + torch.from_numpy(
            rng.standard_normal(tuple(tensors[name].shape)).astype(np.float32) * 1e-3
        )
    size = (checkpoint / "model.safetensors").stat().st_size
    save_file(tensors, str(checkpoint / "model.safetensors"))
    assert (checkpoint / "model.safetensors").stat().st_size == size
    fingerprint._cache.clear()  # the answer must not depend on mtime resolution
    assert weights_fingerprint(checkpoint) != before


def test_fingerprint_reads_a_bounded_sample(checkpoint, monkeypatch):
    reads = []
    original = open

    def counting_open(path, *args, **kwargs):
        handle = original(path, *args, **kwargs)
        real_read = handle.read

        def read(n=-1):
            data = real_read(n)
            reads.append(len(data))
            return data

        handle.read = read
        return handle

    fingerprint._cache.clear()
    monkeypatch.setattr("builtins.open", counting_open)
    weights_fingerprint(checkpoint)
    size = (checkpoint / "model.safetensors").stat().st_size
    assert sum(reads) <= fingerprint.SAMPLES_PER_FILE * fingerprint.SAMPLE_BYTES + 4096 < size
    reads.clear()
    weights_fingerprint(checkpoint)  # cached: nothing read again
    assert reads == []
