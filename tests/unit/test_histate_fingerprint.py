"""The weights fingerprint in HiState's snapshot namespace follows every weight byte.

A weight change in place -- one element of one tensor, file size and mtime
kept -- must change the fingerprint, with this process's cache warm or only
the persistent one (a restart). The element is drawn at random, seeded per
run (the seed is in the assertion message), so no tensor the test names is
special.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vllm_ext.histate import fingerprint
from vllm_ext.histate.fingerprint import CACHE_FILE, UNVERIFIED, weights_fingerprint

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def fresh_process_cache():
    fingerprint.clear_cache()
    yield
    fingerprint.clear_cache()


@pytest.fixture
def checkpoint(tmp_path):
    """Two shards of tensors of mixed dtypes and shapes, plus a config."""
    folder = tmp_path / "model"
    folder.mkdir()
    rng = np.random.default_rng(3)
    for shard in range(2):
        tensors = {
            f"layers.{shard}.{i}.weight": torch.from_numpy(
                rng.standard_normal((int(rng.integers(8, 80)), 96)).astype(np.float32)
            ).to(DTYPES[i % 3])
            for i in range(10)
        }
        save_file(tensors, str(folder / f"model-0000{shard}.safetensors"))
    (folder / "config.json").write_text("{}")
    return folder


def _change_one_element_in_place(folder, seed: int) -> str:
    """Flip one bit of one element of one tensor, drawn by ``seed``; keep size and mtime."""
    rng = np.random.default_rng(seed)
    files = sorted(folder.glob("*.safetensors"))
    path = files[rng.integers(len(files))]
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    names = sorted(k for k in header if k != "__metadata__")
    name = names[rng.integers(len(names))]
    begin, end = header[name]["data_offsets"]
    offset = 8 + length + int(rng.integers(begin, end))
    before = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ (1 << int(rng.integers(8)))]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # as `touch -r` would
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    return f"{path.name}:{name}@{offset}"


def _wait_for_the_file_clock_to_pass(folder) -> None:
    """File times tick coarsely: wait until a new write's ctime differs from the files'."""
    newest = max(os.stat(p).st_ctime_ns for p in folder.glob("*.safetensors"))
    probe = folder.parent / "clock-probe"
    for _ in range(1000):
        probe.write_bytes(b"x")
        if os.stat(probe).st_ctime_ns > newest:
            return
        time.sleep(0.002)
    raise AssertionError("the file clock did not advance")


@pytest.mark.parametrize("restart", [False, True], ids=["same-process", "restart"])
def test_one_element_changed_in_place_with_mtime_restored_changes_the_fingerprint(
    checkpoint, tmp_path, monkeypatch, restart
):
    seed = int.from_bytes(os.urandom(4), "little")
    digests = tmp_path / "ssd"
    # trust digests at once (not only after RACY_NS), so that the caches are really used
    monkeypatch.setattr(fingerprint, "RACY_NS", 0)
    before = weights_fingerprint(checkpoint, cache_dir=digests)
    assert len(fingerprint._cache) == 2 and (digests / CACHE_FILE).exists()
    _wait_for_the_file_clock_to_pass(checkpoint)
    changed = _change_one_element_in_place(checkpoint, seed)
    if restart:
        fingerprint.clear_cache()  # only the persistent digests remain
    after = weights_fingerprint(checkpoint, cache_dir=digests)
    assert after != before, f"seed {seed}: {changed} changed, the fingerprint did not"
    assert not after.startswith(UNVERIFIED)


def test_a_change_right_after_a_hash_is_seen_without_waiting_for_the_clock(checkpoint, tmp_path):
    """Racily clean: digests of files written within RACY_NS of the hash are not reused."""
    seed = int.from_bytes(os.urandom(4), "little")
    before = weights_fingerprint(checkpoint, cache_dir=tmp_path / "ssd")
    assert fingerprint._cache == {}
    changed = _change_one_element_in_place(checkpoint, seed)
    assert weights_fingerprint(checkpoint, cache_dir=tmp_path / "ssd") != before, (
        f"seed {seed}: {changed}"
    )


def test_a_copy_has_the_same_fingerprint(checkpoint, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    assert weights_fingerprint(checkpoint) == weights_fingerprint(copy)
    assert len(weights_fingerprint(copy)) == 32


def test_unreadable_weights_are_unverified_and_never_the_same_twice(tmp_path, monkeypatch):
    """A namespace that cannot be trusted is a miss: it matches no file on disk."""
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for model in (empty, "org/not-in-the-local-hub-cache"):
        first, second = weights_fingerprint(model), weights_fingerprint(model)
        assert first.startswith(UNVERIFIED) and second.startswith(UNVERIFIED)
        assert first != second


def test_unreadable_file_is_unverified(checkpoint, monkeypatch):
    def fail(path, start):
        raise PermissionError(13, "denied", str(path))

    monkeypatch.setattr(fingerprint, "_hash_segment", fail)
    assert weights_fingerprint(checkpoint).startswith(UNVERIFIED)


def test_a_restart_on_unchanged_weights_reads_nothing(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "RACY_NS", 0)
    reads = []
    real = fingerprint._hash_segment
    monkeypatch.setattr(fingerprint, "_hash_segment", lambda p, s: reads.append(p) or real(p, s))
    digests = tmp_path / "ssd"
    value = weights_fingerprint(checkpoint, cache_dir=digests)
    assert len(reads) == 2
    fingerprint.clear_cache()  # a new process: the digests file answers
    assert weights_fingerprint(checkpoint, cache_dir=digests) == value
    assert len(reads) == 2
    (digests / CACHE_FILE).write_text("{not json")  # damaged: everything hashed again
    fingerprint.clear_cache()
    assert weights_fingerprint(checkpoint, cache_dir=digests) == value
    assert len(reads) == 4


def test_segments_cover_every_byte(checkpoint, monkeypatch):
    """With segments smaller than a file, a flipped bit in any segment is still seen."""
    monkeypatch.setattr(fingerprint, "SEGMENT_BYTES", 4096)
    monkeypatch.setattr(fingerprint, "READ_BYTES", 1000)
    seed = int.from_bytes(os.urandom(4), "little")
    before = weights_fingerprint(checkpoint)
    changed = _change_one_element_in_place(checkpoint, seed)
    assert weights_fingerprint(checkpoint) != before, f"seed {seed}: {changed}"
